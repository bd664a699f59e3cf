"""An excerpt of a printed trace: the lines of one FSDP unit, for a reader who will not read the whole trace.

``unit_excerpt(trace_text, unit) -> lines``. The label pass (:mod:`fsdp_pass.passes.label_collectives`)
puts a ``# [fsdp]`` comment naming its unit above every op the pass inserted: the packing of the shards,
the all-gather, its wait and the cut-out in the forward (and in a ZeRO-3 backward, again), the packing of
the gradients, the reduce-scatter, its wait and the unpacking of the reduced shard in the backward. The
excerpt is those comments and the op under each, found by the unit's name, numbered as in the full text,
with one ``...`` line for each run of two or more lines left out.
"""

from __future__ import annotations

LABEL = "# [fsdp]"  # how every comment of the label pass begins


def labels_unit(line: str, unit: str) -> bool:
    """Whether ``line`` is a comment the label pass wrote for ``unit`` (not for a unit whose name extends it)."""
    text = line.strip()
    return text.startswith(LABEL) and f"unit {unit!r}" in text


def unit_line_indices(lines: list[str], unit: str) -> list[int]:
    """Indices of ``unit``'s labels in ``lines``, each with the lines after it up to the op it labels."""
    picked: list[int] = []
    for i, line in enumerate(lines):
        if not labels_unit(line, unit) or (picked and i <= picked[-1]):
            continue
        end = i + 1
        while end < len(lines) and lines[end].lstrip().startswith("#"):
            end += 1
        picked.extend(range(i, min(end + 1, len(lines))))
    return picked


def clip(line: str, width: int) -> str:
    """``line`` cut to ``width`` characters, ending in `` ...`` where something was cut."""
    return line if len(line) <= width else line[: width - 4].rstrip() + " ..."


def with_short_gaps(indices: list[int]) -> list[int]:
    """``indices`` and every index between two of them one apart (a ``...`` line would take as much room)."""
    return sorted({*indices, *(i + 1 for i, j in zip(indices, indices[1:]) if j == i + 2)})


def numbered(lines: list[str], indices: list[int], width: int) -> list[str]:
    """``lines[i]`` for each index, numbered from 1 and dedented together, a ``... N lines ...`` line for each
    gap of two or more lines (a gap of one is shown)."""
    indices = with_short_gaps(indices)
    if not indices:
        return []
    indent = min(len(lines[i]) - len(lines[i].lstrip()) for i in indices)
    digits = len(str(indices[-1] + 1))
    out: list[str] = []
    for previous, i in zip([None, *indices], indices):
        if previous is not None and i > previous + 1:
            out.append(f"{'':>{digits}}  ... {i - previous - 1} lines ...")
        out.append(clip(f"{i + 1:>{digits}}  {lines[i][indent:]}", width))
    return out


def unit_excerpt(trace_text: str, unit: str, width: int = 140) -> list[str]:
    """The lines of ``trace_text`` (a printed trace) that the label pass wrote for ``unit`` and the ops under
    them, numbered as in the text, each cut to ``width`` characters; empty when no label names ``unit``."""
    lines = trace_text.splitlines()
    return numbered(lines, unit_line_indices(lines, unit), width)
