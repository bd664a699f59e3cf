"""Tier 1: what the README names exists, so moving a module or renaming a function cannot leave it behind.

1. Every dotted name under ``fsdp_pass`` or ``fsdp_pass_executors`` (``fsdp_pass.models.zoo.CONFIGS``,
   ``fsdp_pass_executors.executor_choice(device)``, ``-m fsdp_pass.loop``) resolves: its longest importable
   module prefix imports and the rest are attributes.
2. Every ``from fsdp_pass... import a, b`` line of its code blocks imports.
3. Every path it names in backticks under ``fsdp_pass/``, ``executors/``, ``tests/`` or ``bench/`` exists.
"""

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _resolve(dotted: str):
    """The object a dotted name names: the longest prefix that imports as a module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def _unresolved(names) -> list[str]:
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    return missing


def test_every_module_and_function_the_readme_names_exists():
    dotted = set(re.findall(r"\b(fsdp_pass(?:_executors)?(?:\.[A-Za-z_]\w*)+)", README))
    assert len(dotted) > 10  # the pattern finds them
    assert not _unresolved(dotted), _unresolved(dotted)


def test_every_import_in_the_readmes_code_imports():
    imports = re.findall(r"^\s*from (fsdp_pass[\w.]*) import ([\w, ]+)$", README, re.M)
    assert imports  # the pattern finds them
    names = {f"{module}.{name.strip()}" for module, listed in imports for name in listed.split(",")}
    assert not _unresolved(names), _unresolved(names)


def test_every_path_the_readme_names_exists():
    paths = set(re.findall(r"`((?:fsdp_pass|executors|tests|bench)/[\w/.]*)`", README))
    assert len(paths) > 10
    assert not [p for p in sorted(paths) if not (REPO / p).exists()]
