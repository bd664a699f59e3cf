"""One compiled training step of the tests' tiny Llama (3 layers) on a fake group of world size 8.

- ``compile_step(strategy, **fsdp_kwargs) -> (forward trace, backward trace, FSDP transform)`` compiles afresh
  (thunder.jit, ~12 s, most of it Thunder tracing the model's Python).
- ``shared_step(strategy)`` (default options) compiles once per test session: test_units, test_schedule and
  test_demo_output read the same ZeRO-2 and ZeRO-3 steps.
- ``functional_step(strategy, **fsdp_kwargs) -> (forward, backward, UnitPlan)`` is the step with other options,
  made by the functional path (:mod:`fsdp_pass.functional`: the pipeline's stages on Thunder's functional trace)
  from the trace Thunder handed to FSDP in ``shared_step("zero3")``'s compile: a few seconds, the model is not
  traced again. tests/test_functional.py holds the two paths to the same final traces.
  ``functional_plan`` stops after the plan (stages 1-3), for tests that read only the units.

Tests only read these; none may change them.
"""

from __future__ import annotations

import functools

import thunder
import torch
from fsdp_pass_executors import executors_for
from thunder.core.transform_common import Transform

from fsdp_pass import FSDP, fake_process_group
from fsdp_pass.functional import derive_backward_and_lower, shard_functional_trace
from tests import models

WORLD = 8
LAYERS = 3


def llama():
    torch.manual_seed(0)
    return models.TinyLlama(n_layer=LAYERS)


class KeepTraces(Transform):
    """Put before FSDP: keeps the prologue and the functional trace Thunder hands FSDP, changing nothing."""

    traces = None

    def transform_traces_pre_prologue(self, prologue, computation, epilogue, **kwargs):
        self.traces = prologue, computation
        return prologue, computation, epilogue


def compile_step(strategy="zero3", model=None, executors=None, keep: KeepTraces | None = None, **fsdp_kwargs):
    if strategy != "auto":  # the tests read one unit per block; units=None: the step model's default choice
        fsdp_kwargs.setdefault("units", "blocks")
    fsdp_kwargs = {k: v for k, v in fsdp_kwargs.items() if not (k == "units" and v is None)}
    with fake_process_group(WORLD):
        fsdp = FSDP(strategy, **fsdp_kwargs)
        transforms = [fsdp] if keep is None else [keep, fsdp]
        jm = thunder.jit(model or llama(), transforms=transforms, executors=executors or executors_for("cpu"))
        x, y = models.batch("llama_gqa", 2, 0)
        models.loss_fn("llama_gqa", jm(x), y).backward()
        return thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1], fsdp


@functools.cache
def _shared(strategy: str):
    model, keep = llama(), KeepTraces()
    return compile_step(strategy, model=model, keep=keep), (model, *keep.traces)


def shared_step(strategy: str):
    return _shared(strategy)[0]


def shared_functional_trace():
    """(model, prologue, computation): Thunder's functional trace of the shared steps' Llama as FSDP received it in
    ``shared_step("zero3")``'s compile, and the module it came from (its weights are the step's shards now; unit
    items such as ``model.embed`` name its submodules)."""
    return _shared("zero3")[1]


def functional_plan(strategy: str, **fsdp_kwargs):
    """The UnitPlan of the shared Llama's step with these options (stages 1-3 on the shared functional trace)."""
    return _functional(strategy, lower=False, **fsdp_kwargs)


def functional_step(strategy: str, **fsdp_kwargs):
    """(forward, backward, UnitPlan) of the shared Llama's step with these options, by the functional path."""
    return _functional(strategy, lower=True, **fsdp_kwargs)


def _functional(strategy: str, lower: bool, **fsdp_kwargs):
    model, prologue, computation = shared_functional_trace()
    with fake_process_group(WORLD) as group:
        sharded, plan = shard_functional_trace(prologue, computation, group, strategy, model=model, **fsdp_kwargs)
        if not lower:
            return plan
        return (*derive_backward_and_lower(sharded, plan), plan)
