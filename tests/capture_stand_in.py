"""A stand-in for transformers 5's ``transformers/utils/output_capturing.py``, for the tests that run with
transformers 4 (the CI's): the same mechanism, written for these tests, on a tiny model.

- :class:`CompileableContextVar`: a ``ContextVar`` that, under a compiler (``torch.compiler.is_compiling()``, True
  while Thunder interprets), keeps its value in attributes of the object instead: the store Thunder cannot replay.
- ``_active_collector``: the module global the forward wrapper and the hooks share.
- :func:`capture_outputs`: wraps a forward; sets a collector (a dict of the outputs asked for, ``{}`` for none)
  around the call, and returns what the hooks appended to it next to the output.
- :class:`Recorded`: two linear layers whose outputs a forward hook records when ``output_hidden_states=True``.
"""

from __future__ import annotations

from contextvars import ContextVar
from functools import wraps

import torch
from torch import nn


class CompileableContextVar:
    def __init__(self, name):
        self.context_var = ContextVar(name, default=None)
        self.global_var = None
        self.compiling = False

    def get(self):
        return self.global_var if self.compiling else self.context_var.get()

    def set(self, value):
        if torch.compiler.is_compiling():
            self.global_var, self.compiling = value, True
            return None
        return self.context_var.set(value)

    def reset(self, token):
        if self.compiling or token is None:
            self.global_var, self.compiling = None, False
        else:
            self.context_var.reset(token)


_active_collector = CompileableContextVar("output_collector")


def _record(module, args, output):
    collected = _active_collector.get()
    if collected is not None and "hidden_states" in collected:
        collected["hidden_states"].append(output)


def capture_outputs(forward):
    @wraps(forward)
    def wrapper(self, x, output_hidden_states=False):
        collected = {"hidden_states": []} if output_hidden_states else {}
        token = _active_collector.set(collected)
        try:
            out = forward(self, x)
        finally:
            _active_collector.reset(token)
        return (out, tuple(collected["hidden_states"])) if output_hidden_states else out

    return wrapper


class Recorded(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, 2)
        for layer in (self.a, self.b):
            layer.register_forward_hook(_record)

    @capture_outputs
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))
