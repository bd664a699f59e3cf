"""Tier 1: what the README, its pages under docs/ and BENCHMARKS.md name exists, so moving a module, renaming a
function or a command-line flag, or renaming a section cannot leave them behind (BENCHMARKS.md's commands are the
ones that reproduce its tables).

1. Every dotted name under ``fsdp_pass`` or ``fsdp_pass_executors`` (``fsdp_pass.models.zoo.CONFIGS``,
   ``fsdp_pass_executors.executor_choice(device)``, ``-m fsdp_pass.loop``) resolves: its longest importable
   module prefix imports and the rest are attributes.
2. Every ``from fsdp_pass... import a, b`` line of their code imports, and every ``python`` code block compiles.
3. Every path they name in backticks under ``fsdp_pass/``, ``executors/``, ``tests/``, ``bench/`` or
   ``notebooks/`` exists.
4. Every command they give as ``python -m <module> ...`` (``torchrun ... -m <module> ...`` too) for a module of
   this project is accepted by that module's own argument parser: ``main(argv)`` runs up to its
   ``parse_args`` and stops there, so nothing is trained or traced.
5. Every relative link ``[text](page.md#anchor)`` between the README, docs/ and BENCHMARKS.md names a file that
   exists and a heading of it.
"""

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TEXT = {p.relative_to(REPO).as_posix(): p.read_text() for p in [*PAGES, REPO / "BENCHMARKS.md"]}
ALL = "\n".join(TEXT.values())


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


def test_the_readme_links_each_page_under_docs():
    assert len(PAGES) > 5  # the README and its pages
    unlinked = [p.name for p in PAGES[1:] if f"](docs/{p.name}" not in TEXT["README.md"]]
    assert not unlinked, f"pages under docs/ the README does not link: {unlinked}"


@pytest.mark.parametrize("page", TEXT, ids=str)
def test_every_module_and_function_named_exists(page):
    dotted = set(re.findall(r"\b(fsdp_pass(?:_executors)?(?:\.[A-Za-z_]\w*)+)", TEXT[page]))
    assert not _unresolved(dotted), _unresolved(dotted)


def test_the_pages_name_modules_and_functions():
    assert len(set(re.findall(r"\b(fsdp_pass(?:_executors)?(?:\.[A-Za-z_]\w*)+)", ALL))) > 10  # the pattern finds them


def test_every_import_in_the_code_imports():
    imports = re.findall(r"^\s*from (fsdp_pass[\w.]*) import ([\w, ]+)$", ALL, re.M)
    assert imports  # the pattern finds them
    names = {f"{module}.{name.strip()}" for module, listed in imports for name in listed.split(",")}
    assert not _unresolved(names), _unresolved(names)


def test_every_python_block_compiles():
    blocks = [(page, b) for page, text in TEXT.items() for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)]
    assert len(blocks) > 5
    for page, block in blocks:
        compile(block, page, "exec")  # a SyntaxError names the page and the line in the block


def test_every_path_named_exists():
    paths = set(re.findall(r"`((?:fsdp_pass|executors|tests|bench|notebooks)/[\w/.]*)`", ALL))
    assert len(paths) > 10
    assert not [p for p in sorted(paths) if not (REPO / p).exists()]


# 4. commands

def _commands(text: str) -> list[str]:
    """Each ``-m <this project's module> args`` in a code block or an inline code span, continuation lines
    joined; commands cut short (``...``, ``[--optional]``) are left out."""
    spans = re.findall(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", text, re.M | re.S)  # fences in a list item too
    spans = [line for block in spans for line in block.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"^[ \t]*```[^\n]*\n.*?^[ \t]*```", "", text, flags=re.M | re.S)
    spans += [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)]
    found = []
    for span in spans:
        span = re.sub(r"<[^>]*>", "PLACEHOLDER", span)  # hf:<config.json or folder>
        span = re.sub(r"(?<=\s)[A-Z](?=\s|$)", "2", span)  # --world-size N
        for piece in re.split(r"&&|;|\|", span):
            m = re.search(r"(?:^|\s)-m ((?:fsdp_pass|bench)[\w.]*)((?:\s+[^#>]*)?)", piece)
            if not m or "--" not in m.group(2) or "..." in m.group(2) or "[" in m.group(2):  # a name, or cut short
                continue
            found.append(f"{m.group(1)}{m.group(2)}".strip())
    return found


COMMANDS = sorted({c for text in TEXT.values() for c in _commands(text)})


class _Parsed(Exception):
    pass


def _parse_only(command: str) -> str | None:
    """None when ``command``'s module accepts its arguments, else what its parser said."""
    words = shlex.split(command)
    module = words[0] if words[0] != "fsdp_pass" else "fsdp_pass.__main__"
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        real(self, args, namespace)
        raise _Parsed

    said = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), contextlib.redirect_stderr(said), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            importlib.import_module(module).main(words[1:])
        except _Parsed:
            return None
        except SystemExit as e:
            return None if e.code == 0 else said.getvalue() or f"exit {e.code}"
    return "main() returned without parsing its arguments"


def test_the_pages_give_commands():
    assert len(COMMANDS) > 10, COMMANDS  # the pattern finds them
    assert any(c.startswith("fsdp_pass.loop ") for c in COMMANDS) and any(c.startswith("bench.") for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_parses(command):
    said = _parse_only(command)
    assert said is None, f"python -m {command}\n{said}"


# 5. links

def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```[^\n]*\n.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_link_between_pages_resolves():
    broken, checked = [], 0
    for path in [*PAGES, REPO / "BENCHMARKS.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            where = (path.parent / file).resolve() if file else path
            checked += 1
            if not where.exists():
                broken.append(f"{path.name}: {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where):
                broken.append(f"{path.name}: {target} (no heading with that anchor)")
    assert checked > 10
    assert not broken, broken
