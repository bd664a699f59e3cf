"""Check that every rank issues the same collectives, before any rank issues one that would hang.

``check_same_collectives_on_all_ranks(trace, phase, group)``: every rank must issue the same
collectives in the same order.

At each compile, each rank reduces its final forward (or backward) trace to a fingerprint: the
inputs it was compiled for and its collective sequence (kind, elements, dtype). Ranks exchange
fingerprints (one small object all-gather on the FSDP group) and all raise the same error, naming
the first difference, if any rank disagrees. A rank whose program would issue different
collectives therefore stops at its first call instead of deadlocking in a mismatched collective.
"""

from __future__ import annotations

import torch.distributed as dist

from fsdp_pass.errors import fail
from fsdp_pass.predicates import collective_kind, is_collective, is_unpack_trivial


def collective_sequence(trace) -> list[str]:
    out = []
    for b in trace.bound_symbols:
        if is_collective(b):
            t = b.flat_proxy_args[0]
            out.append(f"{collective_kind(b)}({t.numel} x {t.dtype})")
    return out


def input_signature(trace) -> list[str]:
    sig = []
    for b in trace.bound_symbols:
        if is_unpack_trivial(b):
            o = b.output
            shape = getattr(o, "shape", None)
            if shape is not None:
                sig.append(f"{o.name}: {o.dtype} {list(shape)}")
    return sig


def fingerprint(trace, phase: str) -> dict:
    return {"phase": phase, "inputs": input_signature(trace), "collectives": collective_sequence(trace)}


def describe_difference(prints: list[dict]) -> str | None:
    """None when all ranks agree, else a sentence naming the first difference."""
    ref = prints[0]
    for rank, fp in enumerate(prints[1:], start=1):
        if fp == ref:
            continue
        lines = [f"rank 0 and rank {rank} would issue different collectives in the {ref['phase']}."]
        if fp["inputs"] != ref["inputs"]:
            lines.append(f"  rank 0 was compiled for inputs {ref['inputs']}")
            lines.append(f"  rank {rank} was compiled for inputs {fp['inputs']}")
        a, b = ref["collectives"], fp["collectives"]
        for i in range(max(len(a), len(b))):
            ca = a[i] if i < len(a) else "<none>"
            cb = b[i] if i < len(b) else "<none>"
            if ca != cb:
                lines.append(f"  first difference at collective #{i}: rank 0 {ca} vs rank {rank} {cb}")
                break
        lines.append(f"  rank 0 issues {len(a)} collectives, rank {rank} issues {len(b)}.")
        return "\n".join(lines)
    return None


def check_same_collectives_on_all_ranks(trace, phase: str, group) -> None:
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    mine = fingerprint(trace, phase)
    prints: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(prints, mine, group=group)
    diff = describe_difference(prints)
    if diff is not None:
        fail(
            diff,
            "Give every rank inputs of the same shapes and dtypes and the same model and options "
            "(for a ragged last batch: pad it or drop it, e.g. DataLoader(drop_last=True)).",
        )
