"""The main job: a short real training run under the pass, on CPU with gloo ranks.

    torchrun --standalone --nproc_per_node=2 -m fsdp_pass.demo --strategy zero3

1. Every rank builds the same small Llama-style model (seeded) and jits it with ``FSDP``.
2. Each rank trains on its own slice of every global batch (a toy language: count upwards mod V).
3. Rank 0 prints, top to bottom: a header (model, world size, strategy, executors); after the first step
   (it compiles) ``explain()`` (each unit's schedule, bytes per rank against the floor, predicted peak
   memory) and the lines of one unit in the forward and backward traces (its gather and wait, in ZeRO-3
   its gather again in the backward, its reduce-scatter); a progress line per step with the loss
   (averaged over ranks; it falls); a summary: the loss first -> last, the time per step and the part of
   it blocked waiting on collectives, and more forward + backward passes measured (peak tensor memory,
   bytes handed to the process group) next to explain()'s prediction.
4. The full traces and the overlap report (what computes while each collective is in flight) go to files
   under ``--out``, whose paths it prints; ``--traces`` prints them too.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import WAIT_CLOCK, describe, executors_for

from fsdp_pass.api import explain, fsdp_of
from fsdp_pass.errors import check, file_work_on_rank0
from fsdp_pass.models.tiny_lm import TinyLM, counting_batch
from fsdp_pass.models.zoo import WithLoss
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.report.measure import CollectiveBytes, allocated_during
from fsdp_pass.report.run_summary import Measured, Progress, progress_line, summary_lines
from fsdp_pass.report.trace_excerpt import unit_excerpt
from fsdp_pass.transform import FSDP


def measured_against_predicted(jm, x, y, device, repeats: int = 3) -> Measured:
    """More forward + backward passes, measured: bytes handed to the process group, peak tensor memory."""
    peaks, recorded, scratch = [], [], []
    for _ in range(repeats):
        jm.zero_grad(set_to_none=True)
        with CollectiveBytes() as sent:
            allocations = allocated_during(lambda: jm(x, y).backward(), device)
        peaks.append(allocations.peak_bytes)
        recorded.append(allocations.recorded_peak_bytes)
        scratch.append(allocations.process_group_peak_bytes)
    jm.zero_grad(set_to_none=True)
    e = explain(jm)
    return Measured(sent.bytes_sent_per_rank, e.bytes_per_rank, tuple(peaks), e.memory.step.peak_bytes, max(scratch),
                    tuple(recorded))


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="zero3", choices=["zero2", "zero3"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (Schedule(prefetch=...))")
    parser.add_argument("--no-schedule", action="store_true", help="skip the scheduling pass (Thunder's order)")
    parser.add_argument("--out", default="runs/fsdp_demo", help="folder for the full traces and the overlap report")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--traces", action="store_true", help="also print the full traces and the overlap report")
    shown.add_argument("--no-traces", action="store_true", help="print no trace lines (the files are still written)")
    args = parser.parse_args(argv)
    check(args.steps >= 1, f"--steps {args.steps}: the demo needs at least one step.", "Pass --steps 1 or more.")
    return args


def unit_to_show(plan) -> str:
    """The unit of a :class:`~fsdp_pass.plan.units.UnitPlan` whose trace lines the demo prints: the middle
    one (a transformer block, between the embeddings and the head)."""
    return plan.units[len(plan.units) // 2].name


def _out_folder(path: str) -> Path:
    """``--out``, made by rank 0; every rank raises an FSDPError if it cannot be (collective)."""
    file_work_on_rank0(
        lambda: Path(path).mkdir(parents=True, exist_ok=True),
        f"--out {path}: the demo cannot make this folder for its traces: ",
        "Pass --out a folder you can write to.",
        None,
    )
    return Path(path)


def _write_reports(jm, out: Path) -> dict[str, tuple[Path, str]]:
    """The final traces and the overlap report of this rank's compile, each written to a file under ``out``."""
    texts = {
        "forward": ("forward_trace.py", str(thunder.last_traces(jm)[-1])),
        "backward": ("backward_trace.py", str(thunder.last_backward_traces(jm)[-1])),
        "overlap": ("overlap.txt", str(fsdp_of(jm).overlap_report())),
    }
    written = {}
    for what, (name, text) in texts.items():
        (out / name).write_text(text + "\n")
        written[what] = (out / name, text)
    return written


def _show_compile(jm, args, out: Path, say) -> None:
    """After the first step, on rank 0: explain(), one unit's lines of the traces, where the full traces went."""
    say(f"\n{explain(jm)}")
    written = _write_reports(jm, out)
    unit = unit_to_show(fsdp_of(jm).unit_plan)
    if not args.no_traces:
        say(f"\n----- the lines of unit {unit!r} in rank 0's traces (line numbers of the files below) -----")
        for phase in ("forward", "backward"):
            path, text = written[phase]
            say(f"{phase} ({path.name}):")
            say("\n".join(unit_excerpt(text, unit)) or f"  (no line names unit {unit!r})")
    if args.traces:
        for what, (_, text) in written.items():
            say("=" * 30, f"{what} (rank 0)", "=" * 30)
            say(text)
    say("\nfull traces and overlap report (what computes while each collective is in flight), rank 0:")
    say("\n".join(f"  {path}" for path, _ in written.values()) + "\n")


def _train(jm, opt, args, device, out: Path, say):
    """The training loop: a step per global batch, each rank on its slice.

    Returns the losses (averaged over ranks), each step's seconds, the seconds blocked in collective waits
    after the first step, and the last batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    progress = Progress(sys.stdout) if rank == 0 else None
    losses, step_times = [], []
    for step in range(args.steps):
        if step == 1:
            WAIT_CLOCK.reset()  # after the compile step
        x, y = counting_batch(args.batch_per_rank * world, 32, 64, step)
        x, y = (t[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank].to(device) for t in (x, y))
        t0 = time.perf_counter()
        loss = jm(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
        if step == 0 and rank == 0:
            _show_compile(jm, args, out, say)
        if progress is not None:
            progress.show(progress_line(step + 1, args.steps, losses[-1], step_times[-1]))
    if progress is not None:
        progress.close()
    return losses, step_times, WAIT_CLOCK.seconds, (x, y)


def main(argv=None):
    """The run (steps 1-4 of the module docstring) on the default process group: made here from torchrun's
    environment, or a caller's already made (the tests' gloo ranks), which is used as it is and left open."""
    args = _arguments(argv)
    torch.set_num_threads(1)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    say = print if rank == 0 else (lambda *a, **k: None)
    out = _out_folder(args.out)

    torch.manual_seed(0)
    model = WithLoss(TinyLM(n_layer=args.layers)).to(device)  # the loss inside: the traces cover the step
    n_params = sum(p.numel() for p in model.parameters())
    executors = executors_for(device)
    schedule = None if args.no_schedule else Schedule(prefetch=args.prefetch)
    jm = thunder.jit(model, transforms=[FSDP(args.strategy, schedule=schedule)], executors=executors)
    opt = torch.optim.AdamW(jm.parameters(), lr=3e-3)
    say(
        f"fsdp_pass demo: TinyLM ({args.layers} layers, {n_params:,} parameters), {args.strategy}, world size {world} "
        f"({dist.get_backend()}, {torch.device(device).type}), executors: {describe(executors)}\n"
        f"step 1 of {args.steps} compiles the forward and backward first (seconds) ..."
    )
    losses, step_times, waited, (x, y) = _train(jm, opt, args, device, out, say)

    measured = measured_against_predicted(jm, x, y, device)
    local = sum(p.numel() for p in jm.parameters())
    say("\n" + "\n".join(summary_lines(losses, step_times, waited, measured, rank)))
    say(f"  parameters     each rank holds {local:,} of the {n_params:,} parameter elements (its shards)")
    if own_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
