"""The pass's own step cost: one process, world 1 (a one-rank gloo group), plain thunder.jit against FSDP zero3.

    python -m bench.step_cost [--threads 1] [--layers 24] [--rounds 8] [--steps 5] [--profile] [--clock cpu]

A 24-layer Llama-style model at d 64 is almost all per-op overhead, so the gap between the two rows is what
the pass adds per step: its packing ops, the collectives (at world 1 no backend call: a gather or reduce-scatter
returns its input) and
the waits. Prints the median step (forward, loss, backward, AdamW) of each, the two rows taking turns so
that a drifting machine load weighs on both alike; ``--profile`` adds cProfile's
top functions by own time for the FSDP row, to see whether the pass's ops or the compute grew. ``--clock cpu``
times each step by this thread's CPU time (``time.thread_time``) instead of the wall clock: on a shared machine
the wall clock is mostly the wait for a core (one compute thread; at world 1 gloo's threads do no work).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
import warnings

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for

from bench.model import loss_fn, make_batch
from fsdp_pass import FSDP
from fsdp_pass.models.zoo import Config, LlamaLM
from fsdp_pass.ranks import free_port, init_local_gloo


def stepper(transforms, cfg: Config):
    """A compiled, warmed training step (forward, loss, backward, AdamW) of a fresh model."""
    torch.manual_seed(0)
    jm = thunder.jit(LlamaLM(cfg), transforms=transforms, executors=executors_for("cpu"))
    opt = torch.optim.AdamW(jm.parameters(), lr=1e-3)
    x, y = make_batch(0, cfg.local_batch, cfg.seq, 0, cfg.vocab)

    def step():
        loss_fn(jm(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):  # compile, then warm
        step()
    return step


def interleaved_medians(steps: dict, rounds: int, per_round: int, clock=time.perf_counter) -> dict[str, float]:
    """Median step ms of each, the rows taking turns (``per_round`` steps each per round), so that the
    machine's load drifting over the run weighs on every row alike; ``clock``: what times a step."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(per_round):
                t0 = clock()
                step()
                times[name].append(clock() - t0)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def profile_of(step, n: int = 5) -> None:
    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(n)])
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.step_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--steps", type=int, default=5, help="steps of each row per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by the wall clock or by this thread's CPU time (a shared machine)")
    p.add_argument("--units", default=None,
                   help="FSDP's units= (e.g. blocks); left out: the default, units the step model chooses")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    init_local_gloo(0, 1, free_port(), 60)
    units = {} if args.units is None else {"units": args.units}
    cfg = Config(vocab=1000, d=64, n_head=4, hidden=176, n_layer=args.layers, seq=64, local_batch=2)
    steps = {"thunder.jit": stepper([], cfg), "FSDP zero3": stepper([FSDP("zero3", **units)], cfg)}
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    ms = interleaved_medians(steps, args.rounds, args.steps, clock)
    if args.profile:
        profile_of(steps["FSDP zero3"])
    plain, ours = ms["thunder.jit"], ms["FSDP zero3"]
    print(f"{args.layers} layers, d 64, {args.threads} thread(s), median of {args.rounds} x {args.steps} steps "
          f"(rows taking turns): thunder.jit {plain:.1f} ms, FSDP zero3 {ours:.1f} ms ({ours / plain:.2f}x); "
          f"units={args.units or 'the default (the step model)'}; {args.clock} clock")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
