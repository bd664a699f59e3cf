"""tests/tracing_memos.py (installed by tests/conftest.py in this process): Thunder's interpreter gets what it got
without the memos."""

import dis
import traceback

import pytest
import thunder
import torch
from thunder.core import interpreter

from tests import tracing_memos


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
