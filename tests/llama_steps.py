"""One compiled training step of the tests' tiny Llama (3 layers) on a fake group of world size 8.

``compile_step(strategy, **fsdp_kwargs) -> (forward trace, backward trace, FSDP transform)`` compiles
afresh; ``shared_step(strategy)`` (default options) compiles once per test session: test_units and
test_schedule read the same ZeRO-2 and ZeRO-3 steps, at ~12 s a compile. Tests only read them.
"""

from __future__ import annotations

import functools

import thunder
import torch
from fsdp_pass_executors import executors_for

from fsdp_pass import FSDP, fake_process_group
from tests import models

WORLD = 8
LAYERS = 3


def llama():
    torch.manual_seed(0)
    return models.TinyLlama(n_layer=LAYERS)


def compile_step(strategy="zero3", model=None, executors=None, **fsdp_kwargs):
    with fake_process_group(WORLD):
        fsdp = FSDP(strategy, **fsdp_kwargs)
        jm = thunder.jit(model or llama(), transforms=[fsdp], executors=executors or executors_for("cpu"))
        x, y = models.batch("llama_gqa", 2, 0)
        models.loss_fn("llama_gqa", jm(x), y).backward()
        return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1], fsdp


@functools.cache
def shared_step(strategy: str):
    return compile_step(strategy)
