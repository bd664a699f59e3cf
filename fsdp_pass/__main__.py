"""``python -m fsdp_pass explain``: a dry run at any world size on one CPU (see :mod:`fsdp_pass.report.dry_run`).

    python -m fsdp_pass explain --world-size 64 --strategy zero3 --model llama2-7b --out dry_run/
    python -m fsdp_pass explain --world-size 8 --model hf:path/to/Llama-3.2-1B/config.json --seq 2048
    python -m fsdp_pass explain --mesh 8x64 --strategy zero3 --model llama2-7b --layers 4   # HSDP
    python -m fsdp_pass explain --world-size 64 --model llama2-7b --memory-budget 20GiB  # the auto plan
    python -m fsdp_pass explain --world-size 64 --model llama2-7b --cost h100-nvlink  # a plan's predicted step
    python -m fsdp_pass explain --world-size 8 --model llama2-7b --layers 4 --device cpu  # lowered as on the CPU
    python -m fsdp_pass explain --world-size 64 --model llama2-7b --units blocks  # one unit per block
    python -m fsdp_pass probe --local-ranks 2    # a collective's latency and bandwidth, a matmul's rate

prints the FSDP plan with each unit's schedule, the bytes each rank sends per step and the predicted
peak memory per rank, and writes the forward and backward traces to ``--out``. Without ``--units`` the step
model chooses the units, as ``FSDP(...)`` does with ``units=`` left out (:mod:`fsdp_pass.search.default_units`),
from the cost inputs of ``--cost`` (default ``h100-nvlink``, as for the auto plan); ``--units blocks`` gives one
unit per block. ``--model`` takes what :mod:`fsdp_pass.models.spec` builds: a built-in config, a Hugging Face
config, or a factory of your own.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch

from fsdp_pass.errors import FSDPError
from fsdp_pass.models import zoo
from fsdp_pass.models.spec import FACTORY_FORMS, build_model
from fsdp_pass.cost import probe
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.plan.mixed_precision import MixedPrecision
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.report.dry_run import DEVICES, dry_run, target_device
from fsdp_pass.report.explain import OPTIMIZER_STATES
from fsdp_pass.text import human_count

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


_MODEL_HELP = f"""\
--model takes one of:
  {', '.join(zoo.CONFIGS)}
      a built-in Llama-style config (its loss inside); --layers, --seq, --batch override it
  hf:<config.json or folder>
      a Hugging Face causal LM built from its config alone (transformers; no weights, no network),
      fed input_ids and labels of --batch (default 1) x --seq (default: its context, at most 4096)
      tokens; --layers overrides num_hidden_layers
  package.module:factory
      a function of no arguments, called under torch.device("meta"), returning
      {FACTORY_FORMS}: args a tuple of positional inputs, kwargs a dict
      of keyword inputs, e.g. return model, {{"input_ids": ids, "labels": ids}}
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fsdp_pass")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "explain",
        help="dry run: plan, schedule, bytes and memory per rank at any world size",
        description="A dry run: the plan, schedule, bytes and memory per rank of one training step at any "
        "world size, on one CPU, without allocating the model.",
        epilog=_MODEL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--world-size", type=int, help="FSDP over this many ranks")
    ranks.add_argument(
        "--mesh", type=_mesh, help="HSDP: REPLICASxSHARD, e.g. 8x64 (64 ranks per shard group, e.g. a node each, x 8)"
    )
    p.add_argument(
        "--strategy", choices=["zero2", "zero3", "auto"], default=None,
        help="default zero3; auto (implied by --memory-budget): units, resharding, prefetch, offload planned",
    )
    p.add_argument("--memory-budget", default=None, help="auto plan: bytes per rank, e.g. 20GiB")
    p.add_argument(
        "--cost", choices=sorted(DEFAULTS), default=None,
        help="cost inputs: the auto plan's and, without --units, the step model's that chooses the units (default "
        "h100-nvlink); with --strategy zero2/zero3, also print the step time and peak the planner's step model "
        "predicts for the plan",
    )
    p.add_argument(
        "--device", choices=DEVICES, default=None,
        help="the device to lower for: cuda (attention on the fused SDPA kernel, the fusion executor) or cpu (the CPU's "
        "executors); default cuda when the cost inputs (--cost, default h100-nvlink) are a GPU's",
    )
    p.add_argument(
        "--model",
        required=True,
        help="a built-in config, hf:<config.json or folder>, or package.module:factory (see below)",
    )
    p.add_argument(
        "--units", default=None,
        help="left out: FSDP's default, the units the step model chooses (with the cost inputs of --cost, default "
        "h100-nvlink); 'blocks' (one unit per block, the default before), 'per_parameter', or 'size:<MiB>' (BySize)",
    )
    _add_step_options(p)
    probe.add_parser(commands)
    return parser


def _add_step_options(p: argparse.ArgumentParser) -> None:
    """The explain command's options for the step: prefetch, optimizer, shape, precision, offload, output."""
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead (-1: Thunder's order)")
    p.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZER_STATES),
                   help="its state in the memory prediction; the auto plan prices its step too")
    p.add_argument("--layers", type=int, default=None, help="number of layers (built-in and hf: models)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (built-in and hf: models)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank (built-in and hf: models)")
    p.add_argument("--param-dtype", choices=sorted(_DTYPES), default=None, help="mixed precision: gather+compute dtype")
    p.add_argument("--reduce-dtype", choices=sorted(_DTYPES), default="float32", help="mixed precision: reduce dtype")
    p.add_argument("--offload", action="store_true", help="shards, gradients, optimizer state on the CPU")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every unit")
    p.add_argument(
        "--no-sync", action="store_true", help="also show what no_sync() gradient accumulation holds per rank"
    )
    p.add_argument(
        "--every-layer", action="store_true",
        help="interpret every layer of a stack of identical layers (default: five, the rest copied from one of them, "
        "which prints the same plan and traces in a fraction of the time)",
    )
    p.add_argument("--out", default=None, help="folder for forward_trace.py, backward_trace.py, explain.txt")


def _mesh(spec: str) -> tuple[int, int]:
    parts = spec.lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{spec!r} is not REPLICASxSHARD, e.g. 8x64")
    return int(parts[0]), int(parts[1])


def _units(spec: str):
    if spec.startswith("size:"):
        return BySize(int(float(spec[5:]) * 2**20))
    return spec


def explain_command(ns) -> int:
    model = build_model(ns.model, "meta", layers=ns.layers, seq=ns.seq, batch=ns.batch)
    parameters = zoo.param_count(model.module)
    print(f"model {ns.model}: {human_count(parameters)} parameters (meta device, nothing allocated)")
    print(f"example inputs per rank: {model.describe_inputs()}")
    schedule = None if ns.prefetch < 0 else Schedule(prefetch=ns.prefetch)
    precision = None
    if ns.param_dtype:
        precision = MixedPrecision(_DTYPES[ns.param_dtype], _DTYPES[ns.reduce_dtype], output_dtype=torch.float32)
    world_size = ns.mesh[0] * ns.mesh[1] if ns.mesh else ns.world_size
    strategy = ns.strategy or ("auto" if ns.memory_budget else "zero3")
    if strategy == "auto":
        chosen = {"memory_budget": ns.memory_budget, "cost": ns.cost or "h100-nvlink"}  # dry_run passes optimizer
    elif ns.units is None:  # FSDP's default (units= left out): the step model chooses them, as the auto plan would
        chosen = {"schedule": schedule, "cost": ns.cost or "h100-nvlink"}
    else:
        chosen = {"units": _units(ns.units), "schedule": schedule}
        if ns.memory_budget:
            raise FSDPError(f"--memory-budget plans the step, and --strategy {strategy} was asked for.\n"
                            "  What to do: leave out --strategy (or pass --strategy auto) to plan within a budget.")
    device = ns.device or target_device(ns.cost or "h100-nvlink")
    run = dry_run(
        model.module,
        model.args,
        world_size,
        strategy,
        device=device,
        mesh=ns.mesh,
        kwargs=model.kwargs,
        optimizer=ns.optimizer,
        mixed_precision=precision,
        offload_to="cpu" if ns.offload else None,
        checkpoint_activations=ns.checkpoint,
        trace_every_layer=ns.every_layer,
        **chosen,
    )
    print(
        f"traced and lowered as rank 0 of {world_size}"
        + (f" (mesh {ns.mesh[0]} replicas x {ns.mesh[1]} ranks per shard group)" if ns.mesh else "")
        + f" in {run.compile_seconds:.1f} s; executors: {', '.join(run.executors)}"
    )
    print(f"lowered for {run.device}: {run.lowering}" + (f"; {run.copied_layers}" if run.copied_layers else ""))
    if ns.no_sync:
        run = replace(run, explanation=run.explanation.with_no_sync())
    print()
    print(run.explanation)
    if ns.cost and strategy != "auto":
        predicted = run.predict_step(ns.cost)
        print("\n".join(["", f"The auto planner's step model on this plan, cost inputs: {DEFAULTS[ns.cost]}",
                         *predicted.lines()]))
    if ns.out:
        written = run.write(ns.out)
        print("\nwrote " + ", ".join(str(p) for p in written))
    auto, peak = run.explanation.plan.auto, run.explanation.memory.peak  # the traced peak over the budget: exit 3
    return 3 if auto is not None and auto.budget is not None and peak is not None and peak > auto.budget else 0


def main(argv=None) -> int:
    ns = _parser().parse_args(argv)
    try:
        return probe.probe_command(ns) if ns.command == "probe" else explain_command(ns)
    except FSDPError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
