"""What ``FSDP(check_finite=True)`` costs per step: the same model with and without the NaN/inf checks, same run.

    python -m bench.check_finite [--world 2] [--layers 4] [--d 256] [--seq 256] [--rounds 12] [--steps 2]

Each rank builds two ZeRO-3 copies of the Llama-style benchmark model (:mod:`fsdp_pass.models.zoo`), one with the
checks, and trains both (forward, loss, backward, AdamW), the two taking turns so that the machine's load drifting
over the run weighs on both alike. The checks add per unit an ``aminmax`` of its packed shard and of its gradient
before and after the reduce-scatter (on the CPU the whole buffer first, each parameter's part only when it is not
finite; on a GPU one per parameter), one of each block's output, and per forward and per backward one host copy of
that phase's flags and one all-reduce of them (the verdicts). On a shared machine the difference of two step times is noisy, so the time spent inside the
check ops is also clocked directly, per step of the checked row: the checks, and the verdicts (which include any
wait for the slower rank at their all-reduces). Prints rank 0's numbers; gloo ranks on this machine's CPU, one thread
each (``--world 1``: one rank).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from bench.step_cost import interleaved_medians, stepper
from fsdp_pass import FSDP
from fsdp_pass.models.zoo import Config
from fsdp_pass.ops import finite_checks
from fsdp_pass.text import format_table
from fsdp_pass.ranks import run_on_local_ranks

ROWS = {"check_finite=False": False, "check_finite=True": True}
CLOCKED = {"checks": ("check_finite_impl", "clear_finite_flags_impl"), "verdict": ("raise_if_nonfinite_impl",)}


def clock_the_check_ops() -> dict[str, float]:
    """Seconds spent in the check ops' torch code, per kind, from now on (their module functions are wrapped before
    anything is compiled, so the traces bind the wrapped ones)."""
    seconds = {kind: 0.0 for kind in CLOCKED}
    for kind, names in CLOCKED.items():
        for name in names:
            inner = getattr(finite_checks, name)

            def timed(*args, _inner=inner, _kind=kind):
                t0 = time.perf_counter()
                try:
                    return _inner(*args)
                finally:
                    seconds[_kind] += time.perf_counter() - t0

            setattr(finite_checks, name, timed)
    return seconds


def measured(cfg: dict, rounds: int, per_round: int) -> dict[str, float]:
    """On every rank: the median step ms of each row, and the ms per checked step inside the check ops
    (module-level: spawned ranks import it)."""
    warnings.filterwarnings("ignore")
    seconds = clock_the_check_ops()
    config = Config(**cfg)
    steps = {row: stepper([FSDP("zero3", check_finite=on)], config) for row, on in ROWS.items()}
    for kind in seconds:  # the compile and warm-up steps are not counted
        seconds[kind] = 0.0
    ms = interleaved_medians(steps, rounds, per_round)
    return {**ms, **{kind: s * 1e3 / (rounds * per_round) for kind, s in seconds.items()}}


def table(ms: dict[str, float]) -> list[str]:
    off, on = ms["check_finite=False"], ms["check_finite=True"]
    rows = [
        ("check_finite=False", f"{off:.1f}", "-", "-"),
        ("check_finite=True", f"{on:.1f}", f"{on - off:+.1f} ms ({(on - off) / off:+.1%})",
         f"{ms['checks']:.1f} ms checks + {ms['verdict']:.1f} ms verdict ({(ms['checks'] + ms['verdict']) / on:.1%})"),
    ]
    return format_table(("FSDP('zero3', ...)", "median ms/step", "difference", "inside the check ops"), rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.check_finite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=2, help="steps of each row per round")
    args = p.parse_args(argv)
    cfg = dict(vocab=4096, d=args.d, n_head=4, hidden=int(args.d * 2.75), n_layer=args.layers, seq=args.seq,
               local_batch=args.batch)
    ms = run_on_local_ranks(measured, args.world, cfg, args.rounds, args.steps, timeout_s=1800)[0]
    print(f"{args.layers} layers, d {args.d}, {args.batch} x {args.seq} tokens per rank, world {args.world} (gloo, "
          f"CPU, 1 thread per rank), rank 0, {args.rounds} x {args.steps} steps per row, the rows taking turns:")
    print("\n".join(table(ms)))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
