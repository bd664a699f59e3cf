"""While FSDP's compiles trace a model, the cyclic GC does not collect in the middle of Thunder's walk over a dict:
a workaround for a race in Thunder 0.2.6.

The race: the first time traced code reads or writes a dict, Thunder's interpreter wraps each of its entries
(``populate_item_wrappers`` in thunder/core/interpreter.py), iterating the live dict and allocating for every
entry. An automatic collection can run in the middle and run weakref callbacks that delete entries of that very
dict: ``RuntimeError: dictionary changed size during iteration``, and the compile fails. Once a process has run
``torch.compile``, dynamo tags every ``nn.Module`` created afterwards in ``GenerationTracker.generation_values``, an
``ExactWeakKeyDictionary`` whose dicts lose a module's entry when the module dies; a model whose forward creates a
module (a Hugging Face model's ``self.layers[:n]`` is a new ``ModuleList``) makes its trace walk those dicts, over
every module of the process. So a script that runs ``torch.compile`` and then jits an HF model can fail to compile,
now and then (the benchmark does; the test suite's recipe parity test did). Measured when it was found: the tiny
Llama under the recipe's FSDP, 12 compiles in a process with dynamo's tagging, 2,000 live modules and 300 dead ones
in cycles: 1 failure unguarded, 0 guarded.

The guard: :func:`gc_guard` is open around every call of an FSDP-jitted module (where Thunder compiles) and around
the functional path's trace; while it is open, Thunder's interpreter calls :func:`paused_collections`'s version of
``populate_item_wrappers``, which pauses the automatic collections while it walks (what they would free is freed at
the next one; a nested walk leaves them to the outer one). On leaving, Thunder's own function is back: a plain
``thunder.jit`` elsewhere in the process is untouched. Patching that module attribute is the only hook: the
interpreter calls the function by its global name, and nothing the trace runs can step in during the loop. Its cost:
~1,900 walks a compile of a tiny Llama, 40 ns each.

The upstream fix: Thunder walking a snapshot of the dict (``tuple(obj.value.items())``), which cannot change size.
"""

from __future__ import annotations

import functools
import gc
import threading
from contextlib import contextmanager

from thunder.core import interpreter

_GUARDED = "_fsdp_pass_gc_guard"  # set on the guarded function
_lock = threading.Lock()
_open = 0  # guards open now, in any thread
_thunders = None  # the function the interpreter called before the first open guard


def paused_collections(populate):
    """``populate`` (Thunder's ``populate_item_wrappers``) with the cyclic GC's automatic collections paused while
    it walks; a function this returned comes back as it is."""
    if getattr(populate, _GUARDED, False):
        return populate

    @functools.wraps(populate)
    def populate_item_wrappers(obj):
        if not gc.isenabled():
            return populate(obj)
        gc.disable()
        try:
            return populate(obj)
        finally:
            gc.enable()

    setattr(populate_item_wrappers, _GUARDED, True)
    return populate_item_wrappers


def guarded() -> bool:
    """Whether Thunder's interpreter walks dicts with the collections paused now."""
    return getattr(interpreter.populate_item_wrappers, _GUARDED, False)


@contextmanager
def gc_guard():
    """While open (in any thread), Thunder's interpreter walks dicts with the automatic collections paused; when the
    last open guard closes, it calls what it called before the first."""
    global _open, _thunders
    with _lock:
        if _open == 0:
            _thunders = interpreter.populate_item_wrappers
            interpreter.populate_item_wrappers = paused_collections(_thunders)
        _open += 1
    try:
        yield
    finally:
        with _lock:
            _open -= 1
            if _open == 0:
                interpreter.populate_item_wrappers = _thunders
