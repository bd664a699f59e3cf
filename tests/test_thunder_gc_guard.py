"""fsdp_pass.models.thunder_gc_guard: an FSDP compile, a dry run and the functional path's trace go through an
automatic collection that changes a dict while Thunder's interpreter walks it (tests/gc_race.py), and leave
Thunder's own function in place after them.

The test session runs with the guard installed for good (tests/tracing_memos.py); each test here puts Thunder's
own function back first, so that only the package's guard is in the way of the race (the first test shows that
without it the race fails a compile)."""

import inspect

import pytest
import thunder
import torch
from thunder.core import interpreter
from torch import nn

from fsdp_pass import FSDP, fake_process_group
from fsdp_pass.functional import functional_trace
from fsdp_pass.models import thunder_gc_guard
from fsdp_pass.report.dry_run import dry_run
from tests import gc_race


class _Stores(nn.Module):
    """One parameter to shard; a forward that stores into a dict (gc_race.store)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return (gc_race.store(x) * self.weight).sum()


@pytest.fixture
def thunders_own():
    """Thunder's own ``populate_item_wrappers`` for the test (the session's guarded one back after it)."""
    installed = interpreter.populate_item_wrappers
    interpreter.populate_item_wrappers = inspect.unwrap(installed)
    assert not thunder_gc_guard.guarded()
    yield
    interpreter.populate_item_wrappers = installed


def test_unguarded_the_race_fails_a_compile(thunders_own):
    gc_race.arm()
    with pytest.raises(RuntimeError, match="dictionary changed size during iteration"):
        thunder.jit(gc_race.store)(torch.ones(2))


def test_an_fsdp_compile_goes_through_it(thunders_own):
    gc_race.arm()
    with fake_process_group(2):
        jm = thunder.jit(_Stores(), transforms=[FSDP("zero3")])
        jm(torch.ones(8))
    assert gc_race.collected_after()
    assert not thunder_gc_guard.guarded()  # Thunder's own function is back


def test_a_dry_run_goes_through_it(thunders_own):
    gc_race.arm()
    with torch.device("meta"):
        model, x = _Stores(), torch.ones(8)
    dry_run(model, (x,), 4, "zero3")
    assert gc_race.collected_after() and not thunder_gc_guard.guarded()


def test_the_functional_paths_trace_goes_through_it(thunders_own):
    gc_race.arm()
    functional_trace(_Stores(), torch.ones(8))
    assert gc_race.collected_after() and not thunder_gc_guard.guarded()


def test_guards_nest_and_thunders_function_comes_back_after_the_last(thunders_own):
    own = interpreter.populate_item_wrappers
    with thunder_gc_guard.gc_guard():
        with thunder_gc_guard.gc_guard():
            assert thunder_gc_guard.guarded()
        assert thunder_gc_guard.guarded()
    assert interpreter.populate_item_wrappers is own
