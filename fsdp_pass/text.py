"""Text for people: byte counts, parameter counts, tables, and the header every inserted collective carries."""

from __future__ import annotations

from fsdp_pass.op_names import CollectiveKind


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def human_count(n: int) -> str:
    """A count as a person reads it: three significant digits and K, M, B or T (powers of 1000), e.g.
    ``112 K``, ``6.74 B``; below a thousand, the number itself."""
    if abs(n) < 1000:
        return str(n)
    for power, unit in enumerate(("K", "M", "B"), start=1):
        value = f"{n / 1000**power:.3g}"
        if abs(float(value)) < 1000:
            return f"{value} {unit}"
    trillions = n / 1000**4
    return f"{trillions:.3g} T" if abs(trillions) < 999.5 else f"{trillions:,.0f} T"


def format_table(cols, rows) -> list[str]:
    """A header, a dashed rule and one line per row, each column left-aligned to its widest cell."""
    rows = [tuple(str(v) for v in r) for r in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*line).rstrip() for line in [cols, ["-" * w for w in widths], *rows]]


def collective_label(
    unit_name: str, kind: CollectiveKind, n_params: int, shard_bytes: int, world_size: int, padding: int,
    group: str | None = None,
) -> str:
    """The header every inserted collective carries in the printed traces. ``world_size``: the ranks of the
    group it runs on; ``group``: that group's name where there are two (HSDP: ``"shard"``, ``"replicate"``)."""
    what = f"{kind} grads" if kind is not CollectiveKind.ALL_GATHER else str(kind)
    over = "" if group is None else f" over the {group} group ({world_size} ranks)"
    if kind is CollectiveKind.ALL_REDUCE:  # of the reduced shard, in place
        size = f"{human_bytes(shard_bytes)}/rank, the reduced shard"
    else:
        size = f"{human_bytes(shard_bytes)}/rank x {world_size} = {human_bytes(shard_bytes * world_size)}"
    return (
        f"[fsdp] unit {unit_name!r} {what}{over}: {n_params} param(s), {size}"
        + (f", {padding:,} padding elements" if padding else "")
    )


def bullet_lines(items: list[str], limit: int = 12) -> str:
    """``items`` as indented lines under a message, the first ``limit`` of them and a count of the rest."""
    shown = [f"\n    {item}" for item in items[:limit]]
    if len(items) > limit:
        shown.append(f"\n    ... and {len(items) - limit} more")
    return "".join(shown)
