"""Two memos and a guard for Thunder's interpreter, installed in every process of the test session (pytest's, each
gloo rank of tests/rank_pool.py, the notebooks' kernels and their ranks): the tests' time is compile time, and
~80% of a compile of a tiny model is Thunder's interpreter tracing its forward, a third of which went to two
helpers it recomputes for every call it traces, though each one's result depends only on its key:

- ``dis.get_instructions(code)``: the interpreter disassembles a function's code object again at each call of the
  function (``_run_frame`` in thunder/core/interpreter.py);
- ``InterpreterFrame.get_or_make_python_frame()``: a Python frame for the traceback of an exception raised inside
  traced code (a ``hasattr`` that answers False raises one); it makes the frame on a new thread and busy-waits
  for it, a thread switch (the GIL's 5 ms switch interval) each time.

With the memos a call gets what it got without them (the instructions of an equal code object; a frame of the same
code, line and qualified name), so no test checks anything else; only the time changes. Measured on the tiny GQA
Llama, plain ``thunder.jit``, forward and backward of its first call, 2 runs each, load ~2.5: 8.0-8.5 CPU s
without, 6.6-7.2 with the first memo, 5.6-6.9 with both. fsdp_pass itself does not import this module.

One guard, against a race of Thunder's own that made a rank test flake (``dictionary changed size during
iteration``): the cyclic GC collecting while Thunder's interpreter walks a live dict. fsdp_pass guards its own
compiles (:mod:`fsdp_pass.models.thunder_gc_guard`, which says why and measured it); the test processes also jit
models without FSDP (parity references, timings) after ``torch.compile`` ran, so ``install()`` puts the package's
guarded ``populate_item_wrappers`` in for good here.
"""

from __future__ import annotations

import dis
import types
import weakref

_installed = False


def _instructions_memo():
    """A copy of the ``dis`` module whose ``get_instructions(code)`` remembers each code object's instructions."""
    shim = types.ModuleType("dis")
    shim.__dict__.update(dis.__dict__)
    seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    original = dis.get_instructions

    def get_instructions(x, *, first_line=None, show_caches=False, adaptive=False):
        if first_line is not None or show_caches or adaptive or not isinstance(x, types.CodeType):
            return original(x, first_line=first_line, show_caches=show_caches, adaptive=adaptive)
        got = seen.get(x)
        if got is None:
            got = seen[x] = tuple(original(x))
        return iter(got)

    shim.get_instructions = get_instructions
    return shim


def _frame_memo(make):
    frames: dict = {}

    def get_or_make_python_frame(self):
        if self.positions is None:
            return make(self)  # what it asserts against
        key = (self.code, self.positions.lineno, self.qualname)
        frame = frames.get(key)
        if frame is None:
            frame = frames[key] = make(self)
        return frame

    return get_or_make_python_frame


def install() -> None:
    """Install both memos and the guard in this process (once; a Thunder without these helpers is left as it
    is)."""
    global _installed
    if _installed:
        return
    _installed = True
    from thunder.core import interpreter

    from fsdp_pass.models.thunder_gc_guard import paused_collections

    if getattr(interpreter, "dis", None) is dis:
        interpreter.dis = _instructions_memo()
    frame_class = getattr(interpreter, "InterpreterFrame", None)
    make = getattr(frame_class, "get_or_make_python_frame", None)
    if make is not None:
        frame_class.get_or_make_python_frame = _frame_memo(make)
    populate = getattr(interpreter, "populate_item_wrappers", None)
    if populate is not None:  # the interpreter calls it by its global name
        interpreter.populate_item_wrappers = paused_collections(populate)


def _spawned_processes_install_them_too() -> None:
    """The processes a notebook spawns (its gloo ranks: ``run_on_local_ranks``) install the memos too, out of the
    notebook's sight. multiprocessing's spawn runs the parent's main script in the child as ``__mp_main__`` before
    the child's work; a kernel's main module has no script, so this one is named (below, that name installs)."""
    import os
    from multiprocessing import spawn

    original, here = spawn.get_preparation_data, os.path.abspath(__file__)

    def get_preparation_data(name):
        data = original(name)
        if "init_main_from_name" not in data and "init_main_from_path" not in data:
            data["init_main_from_path"] = here
        return data

    spawn.get_preparation_data = get_preparation_data


if __name__ == "__mp_main__":  # a process spawned by a notebook's kernel (above)
    install()

if __name__ == "__main__":
    # a Jupyter kernel with the memos (tests/notebook_runner.py starts the notebooks' kernels so); as
    # ipykernel_launcher does, without this script's folder on the path while the kernel loads (the kernel puts
    # its working directory, the notebooks folder, first)
    import sys

    del sys.path[0]
    install()
    _spawned_processes_install_them_too()
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()
