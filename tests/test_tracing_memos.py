"""tests/tracing_memos.py (installed by tests/conftest.py in this process): Thunder's interpreter gets what it got
without the memos, and the cyclic GC does not run while it iterates a live dict."""

import dis
import traceback

import pytest
import thunder
import torch
from thunder.core import interpreter

from fsdp_pass.models import thunder_gc_guard
from tests import gc_race, tracing_memos


def _raises_at_a_known_line(x):
    y = x * 2
    raise ValueError("from traced code")  # the function's third line
    return y


def _raises_elsewhere(x):
    raise ValueError("from traced code")  # the function's second line


def test_the_interpreter_disassembles_through_the_memo_and_gets_dis_answer():
    tracing_memos.install()  # once per process: a no-op here, conftest installed them
    assert interpreter.dis is not dis and interpreter.dis.Instruction is dis.Instruction
    code = _raises_at_a_known_line.__code__
    for _ in range(2):  # computed, then remembered
        assert tuple(interpreter.dis.get_instructions(code)) == tuple(dis.get_instructions(code))


def test_an_error_in_traced_code_points_at_its_line_each_time():
    """The frame memo: the traceback of an exception raised inside traced code names the line it was raised at,
    the second time (a remembered frame) as the first, and another function's error its own line."""
    for _ in range(2):
        for fn, offset in ((_raises_at_a_known_line, 2), (_raises_elsewhere, 1)):
            with pytest.raises(ValueError, match="from traced code") as info:
                thunder.jit(fn)(torch.ones(2))
            frames = [(f.filename, f.lineno) for f in traceback.extract_tb(info.value.__traceback__)]
            assert (__file__, fn.__code__.co_firstlineno + offset) in frames, frames


def test_a_collection_while_thunder_iterates_a_dict_does_not_change_it():
    """The guard, installed here for the session (the package's, fsdp_pass.models.thunder_gc_guard): a plain
    ``thunder.jit`` walks a dict while an automatic collection is due (tests/gc_race.py; without the guard:
    RuntimeError: dictionary changed size during iteration, the recipe parity test's flake)."""
    assert thunder_gc_guard.guarded()
    gc_race.arm()
    assert thunder.jit(gc_race.store)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert gc_race.collected_after()
