"""8-bit parameter gathers: the peak the step model predicts, the peak the traces hold, what a real step allocates,
and the CPU step time, for bfloat16, int8 and float8_e4m3fn gathers.

    python -m bench.quantized_gathers [--worlds 2 4] [--measure-world 2] [--time-worlds 1 2] [--clock cpu]
                                      [--host-numel N] [--skip dry,measure,time,host]

Every row computes in bfloat16 (``MixedPrecision(bfloat16, output_dtype=float32, gather_dtype=...)``, float32 master
weights), one unit per block.

1. ``dry``: dry runs (one process, a fake group, meta device, lowered as on the CPU) of explain()'s test model (the
   ``tiny`` zoo LM at vocab 256, d 64, 2 layers, its loss inside) under ZeRO-2 and ZeRO-3 at each of ``--worlds``:
   the step model's peak (``DryRun.predict_step``) against the traced one (explain()'s), per rank.
2. ``measure``: the same model trained on ``--measure-world`` gloo ranks spawned here: the allocations of a real
   step (``fsdp_pass.report.measure.allocated_during``, three steps after two warm-up ones) against the traced
   step peak of the same compile (explain()'s, without the shards and the optimizer state, which live before it).
3. ``time``: the CPU step (forward, loss, backward, AdamW) of the benchmark model (``bench.step_cost.stepper``,
   4 layers, d 128) under ZeRO-3 with bfloat16 and int8 gathers at each of ``--time-worlds`` (one compute thread
   per rank), the rows taking turns; the slowest rank's median, by the wall clock or (``--clock cpu``) by each
   rank's compute thread's CPU time (this machine's load weighs on either: say so when quoting it).
4. ``host``: what quantizing an offloaded shard on the host would cost: ``quantize_shards`` of one float32 CPU shard
   of ``--host-numel`` elements into int8 and float8 codes on one thread, the median of five by the thread's CPU
   time, as GB/s of float32 read (the PCIe copy of the float32 shard that quantizing on the host would save runs
   at 25-50 GB/s on a PCIe 4 or 5 x16 link: why an offloaded shard crosses in float32 and is quantized on the GPU).
"""

from __future__ import annotations

import argparse
import time
import warnings

import thunder
import torch
from fsdp_pass_executors import executors_for

from bench.step_cost import Config, interleaved_medians, stepper
from fsdp_pass import FSDP, MixedPrecision, explain
from fsdp_pass.models import zoo
from fsdp_pass.ops.quantize import quantize_shards
from fsdp_pass.plan.quantized_layout import quantized_layout
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.report.measure import allocated_during
from fsdp_pass.text import format_table
from fsdp_pass.ranks import run_on_local_ranks

GATHERS = {"bf16": None, "int8": torch.int8, "float8": torch.float8_e4m3fn}
# explain()'s test model (tests/explain_cases.py)
CONFIG = dict(vocab=256, d=64, n_head=4, hidden=176, n_layer=2, seq=32, local_batch=2)
MiB = 2**20


def precision(gather: str) -> MixedPrecision:
    return MixedPrecision(torch.bfloat16, output_dtype=torch.float32, gather_dtype=GATHERS[gather])


def _model(device: str):
    torch.manual_seed(0)
    module, (idx, _) = zoo.build("tiny", device, **CONFIG)
    if device == "meta":
        return module, (idx, idx)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    idx = torch.randint(0, CONFIG["vocab"], idx.shape, generator=torch.Generator().manual_seed(rank))
    return module, (idx, torch.roll(idx, -1, dims=1))


def dry_rows(worlds) -> list[tuple]:
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


def timed_on_rank(rounds: int, steps: int, clock: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    steps_of = {g: stepper([FSDP("zero3", units="blocks", mixed_precision=precision(g))], Config())
                for g in ("bf16", "int8")}
    return interleaved_medians(steps_of, rounds, steps, time.thread_time if clock == "cpu" else time.perf_counter)


def time_rows(worlds, rounds: int, steps: int, clock: str) -> list[tuple]:
    rows = []
    for world in worlds:
        results = run_on_local_ranks(timed_on_rank, world, rounds, steps, clock, timeout_s=600)
        bf16, int8 = (max(r[g] for r in results) for g in ("bf16", "int8"))
        rows.append((world, f"{bf16:.2f}", f"{int8:.2f}", f"{int8 / bf16:.3f}"))
        print(*rows[-1], flush=True)
    return rows


def host_rows(numel: int, repeats: int = 5) -> list[tuple]:
    torch.set_num_threads(1)
    layout = quantized_layout(((numel,),), 1, 128)
    shard, out = torch.randn(numel), torch.empty(layout.rank_bytes, dtype=torch.uint8)
    rows = []
    for gather in ("int8", "float8"):
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            quantize_shards([shard], layout, GATHERS[gather], out)
            times.append(time.thread_time() - start)
        median = sorted(times)[len(times) // 2]
        rows.append((gather, f"{numel:,}", f"{1e3 * median:.1f}", f"{4 * numel / median / 1e9:.2f}"))
        print(*rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.quantized_gathers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--measure-world", type=int, default=2)
    p.add_argument("--time-worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="steps of each row per round")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by the wall clock or by each rank's compute thread's CPU time (a shared machine)")
    p.add_argument("--host-numel", type=int, default=1 << 24, help="elements of the host shard quantized (host)")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: dry, measure, time, host")
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
                                   time_rows(args.time_worlds, args.rounds, args.steps, args.clock)))
    if "host" not in skip:
        tables.append(format_table(("codes", "float32 elements", "quantize ms", "GB/s of float32"),
                                   host_rows(args.host_numel)))
    for table in tables:
        print("\n".join(table), end="\n\n")


if __name__ == "__main__":
    main()
