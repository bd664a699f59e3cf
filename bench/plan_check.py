"""What the auto planner predicts for the benchmark's plans, next to what the traces say: the predicted half of
the README's "predicted vs measured" table (``bench.run`` measures the other half).

    .venv/bin/python -m bench.plan_check [--world 2] [--budget 22MiB] [--cost cpu-gloo|h100-nvlink|probe]

``--cost probe`` measures the cost inputs first on ``--world`` gloo ranks spawned here (``fsdp_pass.probe``),
as ``bench.run``'s ``ours auto probed`` row does.

In one process, dry runs (fake process group, meta device) of the benchmark model at ``--world`` ranks:

1. ``FSDP("auto")`` without a budget: its summary (pieces, bytes, FLOPs) is what every prediction reads;
2. the hand-written plans of ``bench.peers`` and the auto plan within ``--budget``, each compiled: its units
   (when each is a run of the summary's pieces: per-parameter units are not) become a candidate plan, and
   the step model predicts its step time and its peak.

Columns: the predicted step (compute + optimizer + exposed communication, in ms); the predicted *step* peak
(the peak less the shards and the optimizer state, which live before the step: what ``bench.run``'s ``step peak
MB`` measures) and the traced step peak (``explain()``'s, read off the compiled traces).
"""

from __future__ import annotations

import argparse
import warnings

from bench.peers import OURS_CONFIGS
from fsdp_pass.model_spec import build_model
from fsdp_pass.plan.cost_model import DEFAULTS
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.plan.step_model import Candidate, predict
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.probe import probe_local_ranks
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.text import format_table

ROWS = ("ours zero2 per-param", "ours zero2 blocks", "ours zero3 blocks", "ours zero3 by-size 1.7MB",
        "ours zero2 by-size 1.7MB", "ours zero2 by-size whole", "ours auto")


def _candidate(summary, plan, prefetch: int) -> Candidate | None:
    """The plan's units as runs of the summary's pieces; None when a unit cuts a piece."""
    piece_of = {p: i for i, piece in enumerate(summary.pieces) for p in piece.params}
    starts, flags = [], []
    for unit in plan.units:
        pieces = sorted({piece_of[p] for p in unit.params})
        if pieces != list(range(pieces[0], pieces[-1] + 1)):
            return None
        starts.append(pieces[0])
        flags.append(unit.reshard_after_forward)
    order = sorted(range(len(starts)), key=starts.__getitem__)
    starts = [starts[i] for i in order]
    if len(set(starts)) != len(starts) or starts[0] != 0:
        return None
    return Candidate(tuple(starts), tuple(flags[i] for i in order), prefetch)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--budget", default="22MiB")
    p.add_argument("--cost", default="cpu-gloo", choices=[*sorted(DEFAULTS), "probe"])
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.cost == "probe":
        probed = probe_local_ranks(args.world)
        print(probed)
        cost = probed.cost
    else:
        cost = DEFAULTS[args.cost]
    model = build_model("bench", "meta", layers=None, seq=None, batch=None)

    def compiled(strategy, **options):
        return dry_run(model.module, model.args, args.world, strategy, kwargs=model.kwargs, **options)

    free = compiled("auto", cost=cost)
    summary = free.explanation.plan.auto.summary
    before_step = summary.shard_bytes * (1 + summary.optimizer_states)
    configs = {c[0]: c for c in OURS_CONFIGS}
    rows = []
    for name in (*ROWS, f"ours auto {args.budget}"):
        if name == "ours auto":
            run, prefetch = free, None
        elif name.startswith("ours auto "):
            run, prefetch = compiled("auto", cost=cost, memory_budget=args.budget), None
        else:
            _, strategy, units, prefetch, *_ = configs[name]
            policy = BySize(int(units.split(":")[1])) if units.startswith("by_size:") else units
            run = compiled(strategy, units=policy, schedule=Schedule(prefetch=prefetch))
        plan = run.explanation.plan
        auto = plan.auto
        candidate = auto.candidate if auto is not None else _candidate(summary, plan, prefetch)
        traced = run.explanation.memory.step.peak_bytes
        if candidate is None:
            rows.append((name, len(plan.units), "-", "-", "-", "-", "-", "-", _mib(traced)))
            continue
        pred = predict(summary, candidate, cost)
        rows.append((name, len(plan.units), sum(candidate.reshard), f"{pred.step_s * 1e3:.1f}",
                     f"{pred.compute_s * 1e3:.1f}", f"{pred.optimizer_s * 1e3:.1f}", f"{pred.exposed_s * 1e3:.1f}",
                     _mib(pred.peak_bytes - before_step), _mib(traced)))
    print(f"bench model at world {args.world}, cost inputs {args.cost}: {cost}")
    cols = ("system", "units", "resharded", "pred. step ms", "compute", "optimizer", "exposed", "pred. step peak MiB",
            "traced step peak MiB")
    print("\n".join(format_table(cols, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
