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
2. ``set`` of a collector that asks for outputs (``output_hidden_states``, ``output_attentions``, a mixture of
   experts' ``output_router_logits``, in the call or the config) raises :class:`~fsdp_pass.errors.FSDPError`
   naming the flags to turn off. Keeping the collector out of the interpreter's sight is not enough: the hooks
   do record into it, but the wrapper then stores the tuples with ``ModelOutput.__setitem__``, whose
   ``object.__setattr__`` Thunder 0.2.6's interpreter does not see, so ``outputs.router_logits`` reads None in
   the trace and a model's load-balancing loss would silently drop out of its loss.

``FSDP`` applies it to every module it is given (``FSDP.transform_module``, through
:func:`~fsdp_pass.models.hf_tracing.trace_hf_models` with the causal-mask lookasides); a plain ``thunder.jit`` takes
them by hand, ``jm = trace_hf_models(thunder.jit(model))``. With transformers 4 (no ``output_capturing`` module) or no
transformers imported it adds nothing: those models keep their outputs in Python lists that Thunder traces.
"""

from __future__ import annotations

import sys
import warnings
from types import ModuleType

from fsdp_pass.errors import fail

CAPTURE_MODULE = "transformers.utils.output_capturing"  # transformers >= 5
CONTEXT_VAR_CLASS = "CompileableContextVar"


def capture_lookasides(capturing: ModuleType | None = None) -> dict:
    """``{method: replacement}`` for the ``set``, ``get`` and ``reset`` of ``capturing.CompileableContextVar``;
    ``capturing`` is transformers' ``output_capturing`` module where it is imported, and without one ``{}``. A
    module without that class and its three methods (transformers renamed them) gets none, with a warning that
    names what is missing."""
    capturing = capturing if capturing is not None else sys.modules.get(CAPTURE_MODULE)
    if capturing is None:
        return {}
    context_var = getattr(capturing, CONTEXT_VAR_CLASS, None)
    methods = {name: getattr(context_var, name, None) for name in ("set", "get", "reset")}
    if not all(callable(m) for m in methods.values()):
        missing = [f"{CONTEXT_VAR_CLASS}.{name}" for name, m in methods.items() if not callable(m)]
        version = getattr(sys.modules.get("transformers"), "__version__", "(version unknown)")
        warnings.warn(
            f"fsdp_pass: transformers {version}'s {CAPTURE_MODULE} has no {', '.join(missing)} (renamed or "
            "removed?), so thunder.jit runs its models without fsdp_pass's lookasides "
            "(fsdp_pass/models/hf_output_capture.py): a model whose forward is wrapped in @capture_outputs may "
            "fail to trace. Install the transformers of fsdp_pass's constraints.txt, or report the new name.",
            stacklevel=2,
        )
        return {}
    return {methods["set"]: _set, methods["get"]: _get, methods["reset"]: _reset}


def _set(context_var, collector):
    asked = [key for key in collector or () if not key.startswith("_")]
    if asked:
        flags = ", ".join(f"output_{key}" for key in asked)
        router = (" (the loss then has no load-balancing term: transformers adds router_aux_loss_coef times a "
                  "loss of the router logits only where they are returned)" if "router_logits" in asked else "")
        fail(
            f"The model is asked to return its {', '.join(asked)}, which transformers 5 records with forward hooks "
            "(@capture_outputs) that thunder.jit cannot trace: they hand the tensors back through a module global, "
            "and Thunder 0.2.6 does not see the output attributes they are stored in.",
            f"Pass {', '.join(f + '=False' for f in flags.split(', '))} to the jitted model (in the call and in "
            f"its config){router}, or run that model without thunder.jit.",
        )
    return None


def _get(context_var):
    return None


def _reset(context_var, token):
    return None
