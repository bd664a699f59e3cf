"""``python -m fsdp_pass explain``: a dry run at any world size on one CPU (see :mod:`fsdp_pass.report.dry_run`).

    python -m fsdp_pass explain --world-size 64 --strategy zero3 --model llama2-7b --out dry_run/

prints the FSDP plan with each unit's schedule, the bytes each rank sends per step and the predicted
peak memory per rank, and writes the forward and backward traces to ``--out``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from fsdp_pass import zoo
from fsdp_pass.errors import FSDPError
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.report.explain import OPTIMIZER_STATES


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fsdp_pass")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("explain", help="dry run: plan, schedule, bytes and memory per rank at any world size")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--strategy", choices=["zero2", "zero3"], default="zero3")
    p.add_argument(
        "--model",
        required=True,
        help=f"a built-in config ({', '.join(zoo.CONFIGS)}) or 'package.module:factory' returning (module, args)",
    )
    p.add_argument("--units", default="blocks", help="'blocks', 'per_parameter', or 'size:<MiB>' (BySize)")
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (-1: Thunder's order)")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_STATES))
    p.add_argument("--layers", type=int, default=None, help="override the built-in config's number of layers")
    p.add_argument("--seq", type=int, default=None, help="override the built-in config's sequence length")
    p.add_argument("--batch", type=int, default=None, help="override the built-in config's batch per rank")
    p.add_argument("--param-dtype", choices=sorted(_DTYPES), default=None, help="mixed precision: gather+compute dtype")
    p.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default="float32", help="mixed precision: reduce dtype")
    p.add_argument("--offload", action="store_true", help="shards, gradients, optimizer state on the CPU")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every unit")
    p.add_argument("--out", default=None, help="folder for forward_trace.py, backward_trace.py, explain.txt")
    return parser


def _units(spec: str):
    if spec.startswith("size:"):
        return BySize(int(float(spec[5:]) * 2**20))
    return spec


def explain_command(ns) -> int:
    overrides = {"n_layer": ns.layers, "seq": ns.seq, "local_batch": ns.batch} if ":" not in ns.model else {}
    module, args = zoo.build(ns.model, "meta", **overrides)
    print(f"model {ns.model}: {zoo.param_count(module) / 1e9:.3g} B parameters (meta device, nothing allocated)")
    shapes = ", ".join(f"{tuple(a.shape)} {a.dtype}" for a in args if hasattr(a, "shape"))
    print(f"example inputs per rank: {shapes}")
    schedule = None if ns.prefetch < 0 else Schedule(prefetch=ns.prefetch)
    precision = None
    if ns.param_dtype:
        precision = MixedPrecision(_DTYPES[ns.param_dtype], _DTYPES[ns.reduce_dtype], output_dtype=torch.float32)
    run = dry_run(
        module,
        args,
        ns.world_size,
        ns.strategy,
        units=_units(ns.units),
        schedule=schedule,
        optimizer=ns.optimizer,
        mixed_precision=precision,
        offload_to="cpu" if ns.offload else None,
        checkpoint_activations=ns.checkpoint,
    )
    print(
        f"traced and lowered as rank 0 of {ns.world_size} in {run.compile_seconds:.1f} s; executors: {', '.join(run.executors)}"
    )
    print()
    print(run.explanation)
    if ns.out:
        written = run.write(ns.out)
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


def main(argv=None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return explain_command(ns)
    except FSDPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
