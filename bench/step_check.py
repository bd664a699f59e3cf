"""What the per-step check that every rank runs the same collectives costs: host time in its ops, and the step.

    python -m bench.step_check [--world 2] [--layers 4] [--rounds 8] [--steps 5]

Each of ``--world`` gloo ranks (one compute thread each) builds the benchmark model (:mod:`bench.model`, the one
``bench.run`` trains) twice under ``FSDP("zero3")``, with ``verify_ranks=True`` and ``False``, and trains both
(forward, loss, backward, AdamW), the two taking turns (``rounds`` x ``steps`` each) so that the machine's load
drifting over the run weighs on both alike. Per checked step it also clocks the host time spent inside the check's
ops (whatever functions of :mod:`fsdp_pass.verify.same_collectives_on_all_ranks` end in ``_impl``: one op before
the change of issue 40, three after it): what the check holds the step's host thread for, waits for the slower
rank included. Prints, for the slowest rank, the median step of each row and the median time in the check's ops.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from bench.model import build_model, loss_fn, make_batch
from bench.step_cost import interleaved_medians

CLOCK = {"seconds": 0.0}


def _timed(fn):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCK["seconds"] += time.perf_counter() - t0

    return wrapped


def clock_check_ops() -> list[str]:
    """Wrap the check's op bodies (before any compile binds them into a trace); their names."""
    from fsdp_pass.verify import same_collectives_on_all_ranks as module

    names = [n for n in vars(module) if n.endswith("_impl") and callable(getattr(module, n))]
    for n in names:
        setattr(module, n, _timed(getattr(module, n)))
    return names


def _stepper(verify: bool, layers: int):
    import thunder
    from fsdp_pass_executors import executors_for

    from fsdp_pass import FSDP

    jm = thunder.jit(build_model(n_layer=layers), transforms=[FSDP("zero3", verify_ranks=verify)],
                     executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)
    x, y = make_batch(0, rank=dist.get_rank())

    def step():
        loss_fn(jm(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    return step


def on_rank(layers: int, rounds: int, steps: int) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = clock_check_ops()
    checked, unchecked = _stepper(True, layers), _stepper(False, layers)
    per_step = []

    def clocked():
        before = CLOCK["seconds"]
        checked()
        per_step.append(CLOCK["seconds"] - before)

    ms = interleaved_medians({"checked": clocked, "unchecked": unchecked}, rounds, steps)
    return {**ms, "check_ms": statistics.median(per_step) * 1e3, "ops": names}


def main(argv=None) -> None:
    from fsdp_pass.ranks import run_on_local_ranks

    p = argparse.ArgumentParser(prog="python -m bench.step_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps of each row per round")
    args = p.parse_args(argv)
    results = run_on_local_ranks(on_rank, args.world, args.layers, args.rounds, args.steps, timeout_s=600)
    slowest = lambda key: max(r[key] for r in results)  # noqa: E731
    per_rank = ", ".join(f"{r['check_ms']:.3f}" for r in results)
    print(f"world {args.world}, {args.layers} layers (bench.model), zero3, median of {args.rounds} x {args.steps} "
          f"steps (rows taking turns), slowest rank: step with the check {slowest('checked'):.1f} ms, without "
          f"{slowest('unchecked'):.1f} ms; host time in the check's ops per step {slowest('check_ms'):.3f} ms "
          f"(per rank: {per_rank}; ops {', '.join(results[0]['ops'])})")


if __name__ == "__main__":
    main()
