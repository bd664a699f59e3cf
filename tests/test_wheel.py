"""Tier 1: the package as a user installs it, a built wheel, imports and runs with the source tree off the path.

1. The sources the wheel is built from (pyproject.toml, setup.py, README.md, fsdp_pass/, executors/) are copied
   to a temporary folder, and ``pip wheel --no-deps --no-build-isolation --no-index`` builds the wheel there
   (no network: the build uses this environment's setuptools).
2. ``pip install --no-deps --target`` unpacks it into a folder of its own.
3. Every module of the source tree is in the wheel (``executors/`` as ``fsdp_pass_executors``).
4. A fresh interpreter started with ``-S`` (no site: this environment's editable install of the tree, a ``.pth``
   hook, is not loaded), ``PYTHONPATH`` = that folder + this environment's site-packages (torch, Thunder), and
   its working directory outside the repository, runs ``python -m fsdp_pass --help`` and ``python -m
   fsdp_pass.loop --help`` (through runpy, as ``-m`` does) and imports every module from the wheel; a second one
   runs ``python -m fsdp_pass explain``, a dry run of the smallest built-in model at world size 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILT_FROM = ("pyproject.toml", "setup.py", "README.md")
PACKAGE_FOLDERS = {"fsdp_pass": "fsdp_pass", "executors": "fsdp_pass_executors"}  # folder -> import name


def _source_modules() -> set[str]:
    """Every module of the source tree, by import name (``executors/x.py`` is ``fsdp_pass_executors.x``)."""
    names = set()
    for folder, import_name in PACKAGE_FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.add(".".join((import_name, *parts)))
    return names


def _wheel_modules(wheel: Path) -> set[str]:
    """Every module a wheel holds, by import name."""
    names = set()
    for name in zipfile.ZipFile(wheel).namelist():
        if name.endswith(".py"):
            parts = Path(name).with_suffix("").parts
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def _copy_sources(to: Path) -> None:
    """What the wheel is built from, without caches (so nothing of an earlier build or run can slip in)."""
    for name in BUILT_FROM:
        if (REPO / name).exists():  # setup.py: the build takes the packages from it when there is one
            shutil.copy2(REPO / name, to / name)
    for folder in PACKAGE_FOLDERS:
        shutil.copytree(REPO / folder, to / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The folder the built wheel is installed into, and the wheel's path."""
    root = tmp_path_factory.mktemp("wheel")
    sources, dist, site = root / "src", root / "dist", root / "site"
    sources.mkdir()
    _copy_sources(sources)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(sources))
    (wheel,) = dist.glob("fsdp_pass-*.whl")
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel))
    return site, wheel


def _clean_interpreter(site: Path, *args: str) -> subprocess.Popen:
    """A Python that sees the installed wheel and this environment's dependencies, not the source tree."""
    dependencies = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *sorted(dependencies)])
    return subprocess.Popen(
        [sys.executable, "-S", *args], cwd=site.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finished(process: subprocess.Popen, what: str, timeout: float = 180) -> str:
    stdout, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"{what} failed from the wheel:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return stdout


IMPORT_EVERY_MODULE_AND_ASK_FOR_HELP = """
import contextlib, importlib, io, json, runpy, sys
helps = {}
for command in ("fsdp_pass", "fsdp_pass.loop"):  # as `python -m <command> --help` runs them
    sys.argv, text = [command, "--help"], io.StringIO()
    with contextlib.redirect_stdout(text), contextlib.suppress(SystemExit):
        runpy.run_module(command, run_name="__main__", alter_sys=True)
    helps[command] = text.getvalue()
files = {name: importlib.import_module(name).__file__ for name in json.loads(sys.argv_modules)}
import fsdp_pass
print(json.dumps({"files": files, "version": fsdp_pass.__version__, "path": sys.path, "helps": helps}))
"""


def test_the_wheel_holds_every_module_of_the_source_tree(installed):
    _, wheel = installed
    missing = _source_modules() - _wheel_modules(wheel)
    assert not missing, f"the wheel lacks {sorted(missing)}: setup.py does not find them"


def test_the_wheel_imports_and_runs_its_commands_without_the_source_tree(installed):
    site, _ = installed
    modules = json.dumps(sorted(_source_modules()))
    # two interpreters at once (each imports torch and Thunder, a few seconds)
    started = {
        "import and --help": _clean_interpreter(
            site, "-c", IMPORT_EVERY_MODULE_AND_ASK_FOR_HELP.replace("sys.argv_modules", repr(modules))
        ),
        "dry run": _clean_interpreter(
            site, "-m", "fsdp_pass", "explain", "--world-size", "2", "--model", "tiny", "--strategy", "zero3"
        ),
    }
    out = {what: _finished(process, what) for what, process in started.items()}

    imported = json.loads(out["import and --help"].splitlines()[-1])
    assert str(REPO) not in imported["path"] and str(REPO / "fsdp_pass") not in imported["path"]
    outside = {name: f for name, f in imported["files"].items() if not Path(f).resolve().is_relative_to(site)}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    assert imported["version"] == re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]

    assert "explain" in imported["helps"]["fsdp_pass"] and "probe" in imported["helps"]["fsdp_pass"]
    assert "--checkpoint-dir" in imported["helps"]["fsdp_pass.loop"]
    assert "world size 2" in out["dry run"] and "step peak" in out["dry run"]


def test_version_in_a_source_tree_that_was_never_installed_comes_from_pyproject(monkeypatch):
    import importlib.metadata

    import fsdp_pass

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    version = re.search(r'^version = "(.+)"', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert fsdp_pass._version() == f"{version}+source"
