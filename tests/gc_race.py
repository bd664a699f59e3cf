"""The race :mod:`fsdp_pass.models.thunder_gc_guard` guards against, made to happen at once: an automatic collection
that changes a dict while Thunder's interpreter walks it.

``arm()`` fills :data:`table` with a key whose next hash leaves a dead cycle with a weakref callback that adds an
entry to ``table``, then allocates past the GC's generation-0 threshold, so the automatic collection that frees the
cycle runs right there, inside whatever hashes the key. Traced code that stores into ``table`` (:func:`store`) makes
Thunder walk ``table``, hashing each key: unguarded, ``RuntimeError: dictionary changed size during iteration``
(dynamo's ``ExactWeakKeyDictionary`` loses entries so; this one gains one, which leaves the entries Thunder's
prologue reads in place). ``collected_after()``: the key was hashed, the GC runs again, and the cycle, there to
free, is freed by the next collection.
"""

import gc
import weakref

table: dict = {}
_callbacks: list = []


class _Cycle:
    def __init__(self):
        self.me = self  # freed only by the cyclic GC


class _CollectsWhenHashed(str):
    """A key whose hash, once armed, collects (see the module); a ``str`` to Thunder's prologue."""

    armed = False

    def __hash__(self):
        if _CollectsWhenHashed.armed:
            _CollectsWhenHashed.armed = False
            _callbacks.append(weakref.ref(_Cycle(), lambda _: table.setdefault("added", 3)))
            kept = [[] for _ in range(2 * gc.get_threshold()[0] + 1)]  # noqa: F841 (alive: each counts)
        return str.__hash__(self)


def arm() -> None:
    table.clear()
    table.update({_CollectsWhenHashed("armed"): 0, "one": 1, "two": 2})
    _CollectsWhenHashed.armed = True
    assert gc.isenabled()


def store(x):
    table["new"] = "stored"  # Thunder's dict-store lookaside first wraps each entry of table: hashes each key
    return x * 2


def collected_after() -> bool:
    hashed = not _CollectsWhenHashed.armed
    gc.collect()
    return hashed and gc.isenabled() and table.get("added") == 3 and table["new"] == "stored"
