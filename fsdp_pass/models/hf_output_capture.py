"""Hugging Face transformers 5's output capture, traced by ``thunder.jit``.

transformers 5 wraps a model's forward in ``@capture_outputs`` (``transformers/utils/output_capturing.py``), which
records hidden states and attentions with forward hooks. The wrapper hands the hooks a collector through a module
global, ``_active_collector``, a ``CompileableContextVar``; under a compiler (``torch.compiler.is_compiling()``,
which Thunder's interpreter answers True) its ``set`` stores the collector in an attribute of that global object.
Thunder's interpreter records the store as a change to state outside the traced function and cannot replay it: the
first call fails in ``process_recorded_modifications`` with ``AssertionError: trying to set .global_var of
ProvenanceRecord(... '_active_collector') to object of type dict`` (Thunder 0.2.6, transformers 5.17.0; a plain
``thunder.jit(model)`` as much as one with FSDP).

:func:`capture_lookasides` gives a jitted module lookasides (Thunder runs them instead of interpreting the
methods) for the collector's ``set``, ``get`` and ``reset``, so the interpreter runs no code that stores it:

1. ``set`` of an empty collector (no output asked for: a training step) does nothing, ``get`` returns None and
   ``reset`` does nothing: the hooks, where installed, find no collector, as they do in eager when nothing is
   recorded. The traces are those of transformers 4's step.
2. ``set`` of a collector that asks for outputs (``output_hidden_states`` or ``output_attentions``, in the call or
   the config) raises :class:`~fsdp_pass.errors.FSDPError`: the recorded tensors would reach the model's output
   only through that global, which Thunder does not follow (they fail its prologue's checks).

``FSDP`` applies it to every module it is given (``FSDP.transform_module``, through
:func:`~fsdp_pass.models.hf_tracing.trace_hf_models` with the causal-mask lookasides); a plain ``thunder.jit`` takes
them by hand, ``jm = trace_hf_models(thunder.jit(model))``. With transformers 4 (no ``output_capturing`` module) or no
transformers imported it adds nothing: those models keep their outputs in Python lists that Thunder traces.
"""

from __future__ import annotations

import sys
from types import ModuleType

from fsdp_pass.errors import fail

CAPTURE_MODULE = "transformers.utils.output_capturing"  # transformers >= 5
CONTEXT_VAR_CLASS = "CompileableContextVar"


def capture_lookasides(capturing: ModuleType | None = None) -> dict:
    """``{method: replacement}`` for the ``set``, ``get`` and ``reset`` of ``capturing.CompileableContextVar``;
    ``capturing`` is transformers' ``output_capturing`` module where it is imported, and without one ``{}``."""
    capturing = capturing if capturing is not None else sys.modules.get(CAPTURE_MODULE)
    context_var = getattr(capturing, CONTEXT_VAR_CLASS, None)
    if context_var is None:
        return {}
    return {context_var.set: _set, context_var.get: _get, context_var.reset: _reset}


def _set(context_var, collector):
    if collector:
        asked = ", ".join(key for key in collector if not key.startswith("_"))
        fail(
            f"The model is asked to return its {asked}, which transformers 5 records with forward hooks "
            "(@capture_outputs) that thunder.jit cannot trace: they hand the tensors back through a module global.",
            "Leave output_hidden_states and output_attentions False (in the model's config and in the call) for "
            "the jitted model, or run it with transformers<5 (4.52 is tested).",
        )
    return None


def _get(context_var):
    return None


def _reset(context_var, token):
    return None
