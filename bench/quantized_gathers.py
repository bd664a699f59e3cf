"""8-bit parameter gathers: the peak the step model predicts, the peak the traces hold, what a real step allocates,
and the CPU step time, for bfloat16, int8 and float8_e4m3fn gathers.

    python -m bench.quantized_gathers [--worlds 2 4] [--measure-world 2] [--time-worlds 1 2] [--skip dry,measure,time]

Every row computes in bfloat16 (``MixedPrecision(bfloat16, output_dtype=float32, gather_dtype=...)``, float32 master
weights), one unit per block.

1. ``dry``: dry runs (one process, a fake group, meta device, lowered as on the CPU) of explain()'s test model (the
   ``tiny`` zoo LM at vocab 256, d 64, 2 layers, its loss inside) under ZeRO-2 and ZeRO-3 at each of ``--worlds``:
   the step model's peak (``DryRun.predict_step``) against the traced one (explain()'s), per rank.
2. ``measure``: the same model trained on ``--measure-world`` gloo ranks spawned here: the allocations of a real
   step (``fsdp_pass.report.measure.allocated_during``, three steps after two warm-up ones) against the traced
   step peak of the same compile (explain()'s, without the shards and the optimizer state, which live before it).
3. ``time``: the CPU step (forward, loss, backward, AdamW) of the benchmark model (:mod:`bench.model`, 4 layers,
   d 128) under ZeRO-3 with bfloat16 and int8 gathers at each of ``--time-worlds``, the rows taking turns; the
   slowest rank's median, by the wall clock (this machine's load weighs on it: say so when quoting it).
"""

from __future__ import annotations

import argparse
import warnings

import torch

from fsdp_pass.plan.mixed_precision import MixedPrecision

GATHERS = {"bf16": None, "int8": torch.int8, "float8": torch.float8_e4m3fn}
# explain()'s test model (tests/explain_cases.py)
CONFIG = dict(vocab=256, d=64, n_head=4, hidden=176, n_layer=2, seq=32, local_batch=2)
MiB = 2**20


def precision(gather: str) -> MixedPrecision:
    return MixedPrecision(torch.bfloat16, output_dtype=torch.float32, gather_dtype=GATHERS[gather])


def _model(device: str):
    from fsdp_pass.models import zoo

    torch.manual_seed(0)
    module, (idx, _) = zoo.build("tiny", device, **CONFIG)
    if device == "meta":
        return module, (idx, idx)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    idx = torch.randint(0, CONFIG["vocab"], idx.shape, generator=torch.Generator().manual_seed(rank))
    return module, (idx, torch.roll(idx, -1, dims=1))


def dry_rows(worlds) -> list[tuple]:
    from fsdp_pass.report.dry_run import dry_run

    rows = []
    for world in worlds:
        for strategy in ("zero2", "zero3"):
            for gather in GATHERS:
                run = dry_run(*_model("meta"), world, strategy, device="cpu", units="blocks",
                              mixed_precision=precision(gather))
                predicted, traced = run.predict_step().peak_bytes, run.explanation.memory.peak
                rows.append((world, strategy, gather, f"{predicted / MiB:.3f}", f"{traced / MiB:.3f}",
                             f"{predicted / traced:.4f}"))
                print(*rows[-1], flush=True)
    return rows


def measured_on_rank(gather: str, strategy: str) -> dict:
    """A few real steps of the test model on this rank: the measured allocations of the last three, and explain()'s
    traced step peak."""
    import thunder
    from fsdp_pass_executors import executors_for

    from fsdp_pass import FSDP, explain
    from fsdp_pass.report.measure import allocated_during

    warnings.filterwarnings("ignore")
    module, args = _model("cpu")
    jm = thunder.jit(module, transforms=[FSDP(strategy, units="blocks", mixed_precision=precision(gather))],
                     executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)
    peaks = []
    for i in range(5):
        opt.zero_grad(set_to_none=True)
        if i < 2:
            jm(*args).backward()
        else:
            peaks.append(allocated_during(lambda: jm(*args).backward()).peak_bytes)
        opt.step()
    return {"measured": peaks, "traced": explain(jm).memory.step.peak_bytes}


def measure_rows(world: int) -> list[tuple]:
    from fsdp_pass.shard.groups import run_on_local_ranks

    rows = []
    for strategy in ("zero2", "zero3"):
        for gather in GATHERS:
            results = run_on_local_ranks(measured_on_rank, world, gather, strategy, timeout_s=600)
            traced = results[0]["traced"]
            measured = [p for r in results for p in r["measured"]]
            worst = max(measured, key=lambda p: abs(p - traced))
            rows.append((world, strategy, gather, traced, f"{min(measured)}..{max(measured)}", worst - traced))
            print(*rows[-1], flush=True)
    return rows


def timed_on_rank(rounds: int, steps: int) -> dict:
    import thunder
    from fsdp_pass_executors import executors_for

    from bench.model import build_model, loss_fn, make_batch
    from bench.step_cost import interleaved_medians
    from fsdp_pass import FSDP

    warnings.filterwarnings("ignore")
    x, y = make_batch(0, rank=torch.distributed.get_rank())

    def stepper(gather: str):
        jm = thunder.jit(build_model(), transforms=[FSDP("zero3", units="blocks", mixed_precision=precision(gather))],
                         executors=executors_for("cpu"))
        opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)

        def step():
            loss_fn(jm(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        return step

    return interleaved_medians({g: stepper(g) for g in ("bf16", "int8")}, rounds, steps)


def time_rows(worlds, rounds: int, steps: int) -> list[tuple]:
    from fsdp_pass.shard.groups import run_on_local_ranks

    rows = []
    for world in worlds:
        results = run_on_local_ranks(timed_on_rank, world, rounds, steps, timeout_s=600)
        bf16, int8 = (max(r[g] for r in results) for g in ("bf16", "int8"))
        rows.append((world, f"{bf16:.2f}", f"{int8:.2f}", f"{int8 / bf16:.3f}"))
        print(*rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    from fsdp_pass.report.text import format_table

    p = argparse.ArgumentParser(prog="python -m bench.quantized_gathers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--measure-world", type=int, default=2)
    p.add_argument("--time-worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps of each row per round")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: dry, measure, time")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    skip = set(args.skip.split(","))
    tables = []
    if "dry" not in skip:
        tables.append(format_table(("world", "strategy", "gather", "predicted MiB", "traced MiB", "ratio"),
                                   dry_rows(args.worlds)))
    if "measure" not in skip:
        tables.append(format_table(("world", "strategy", "gather", "traced step B", "measured step B",
                                    "worst - traced B"), measure_rows(args.measure_world)))
    if "time" not in skip:
        tables.append(format_table(("world", "bf16 ms", "int8 ms", "int8 / bf16"),
                                   time_rows(args.time_worlds, args.rounds, args.steps)))
    for table in tables:
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
