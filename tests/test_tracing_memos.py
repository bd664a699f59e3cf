"""tests/tracing_memos.py (installed by tests/conftest.py in this process): Thunder's interpreter gets what it got
without the memos, and the cyclic GC does not run while it iterates a live dict."""

import dis
import gc
import traceback
import weakref

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


_table: dict = {}
_callbacks: list = []


class _Cycle:
    def __init__(self):
        self.me = self  # freed only by the cyclic GC


class _CollectsWhenHashed(str):
    """A key whose hash, once armed, leaves a dead cycle whose weakref callback changes ``_table``'s size, then
    allocates past the GC's generation-0 threshold: the automatic collection that frees the cycle runs right there,
    inside whatever hashes the key (dynamo's ``ExactWeakKeyDictionary`` loses entries so; this one gains one, which
    leaves the entries Thunder's prologue reads in place). A ``str`` to Thunder's prologue."""

    armed = False

    def __hash__(self):
        if _CollectsWhenHashed.armed:
            _CollectsWhenHashed.armed = False
            _callbacks.append(weakref.ref(_Cycle(), lambda _: _table.setdefault("added", 3)))
            kept = [[] for _ in range(2 * gc.get_threshold()[0] + 1)]  # noqa: F841 (alive: each counts)
        return str.__hash__(self)


def _store(x):
    _table["new"] = "stored"  # Thunder's dict-store lookaside first wraps each entry of _table: hashes each key
    return x * 2


def test_a_collection_while_thunder_iterates_a_dict_does_not_change_it():
    """The guard: the GC does not run while Thunder iterates a live dict, so a weakref callback that changes the
    dict cannot fire in the middle (without it: RuntimeError: dictionary changed size during
    iteration, the recipe parity test's flake)."""
    _table.clear()
    _table.update({_CollectsWhenHashed("armed"): 0, "one": 1, "two": 2})
    _CollectsWhenHashed.armed = True
    assert gc.isenabled()
    assert thunder.jit(_store)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert not _CollectsWhenHashed.armed and gc.isenabled()  # Thunder hashed the key; the GC runs again
    gc.collect()
    assert _table.get("added") == 3 and _table["new"] == "stored"  # the cycle was there to free: freed after
