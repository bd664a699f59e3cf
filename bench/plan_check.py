"""What the auto planner predicts for the benchmark's plans, next to what the traces say: the predicted half of
the README's "predicted vs measured" table (``bench.run`` measures the other half).

    .venv/bin/python -m bench.plan_check [--world 2] [--budget 22MiB] [--cost cpu-gloo|h100-nvlink|probe]

``--cost probe`` measures the cost inputs first on ``--world`` gloo ranks spawned here (``fsdp_pass.cost.probe``),
as ``bench.run``'s ``ours auto probed`` row does.

In one process, dry runs (fake process group, meta device) of the benchmark model at ``--world`` ranks:

1. ``FSDP("auto")`` without a budget (its summary of the step also gives what lives before the step);
2. the hand-written plans of ``bench.peers`` and the auto plan within ``--budget``, each compiled, and priced
   by the step model (``DryRun.predict_step``, :mod:`fsdp_pass.cost.price_plan`): its step time and its peak
   (per-parameter units cut the pieces the model prices: "-").

Columns: the predicted step (compute + optimizer + exposed communication, in ms); the predicted *step* peak
(the peak less the shards and the optimizer state, which live before the step: what ``bench.run``'s ``step peak
MB`` measures) and the traced step peak (``explain()``'s, read off the compiled traces).
"""

from __future__ import annotations

import argparse
import warnings

from bench.peers import OURS_CONFIGS
from fsdp_pass.errors import FSDPError
from fsdp_pass.models.spec import build_model
from fsdp_pass.cost.cost_model import DEFAULTS
from fsdp_pass.cost.probe import probe_local_ranks
from fsdp_pass.plan.schedule import Schedule
from fsdp_pass.plan.unit_policies import BySize
from fsdp_pass.report.dry_run import dry_run
from fsdp_pass.text import format_table

ROWS = ("ours zero2 per-param", "ours zero2 blocks", "ours zero3 blocks", "ours zero3 by-size 1.7MB",
        "ours zero2 by-size 1.7MB", "ours zero2 by-size whole", "ours auto")


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
    before_step = summary.state_bytes
    configs = {c[0]: c for c in OURS_CONFIGS}
    rows = []
    for name in (*ROWS, f"ours auto {args.budget}"):
        if name == "ours auto":
            run = free
        elif name.startswith("ours auto "):
            run = compiled("auto", cost=cost, memory_budget=args.budget)
        else:
            _, strategy, units, prefetch, *_ = configs[name]
            policy = BySize(int(units.split(":")[1])) if units.startswith("by_size:") else units
            run = compiled(strategy, units=policy, schedule=Schedule(prefetch=prefetch))
        plan = run.explanation.plan
        traced = run.explanation.memory.step.peak_bytes
        try:
            pred = run.predict_step(cost)
        except FSDPError:  # per-parameter units cut the pieces the step model prices
            rows.append((name, len(plan.units), "-", "-", "-", "-", "-", "-", _mib(traced)))
            continue
        resharded = sum(u.reshard_after_forward for u in plan.units)
        rows.append((name, len(plan.units), resharded, f"{pred.step_s * 1e3:.1f}",
                     f"{pred.compute_s * 1e3:.1f}", f"{pred.optimizer_s * 1e3:.1f}", f"{pred.exposed_s * 1e3:.1f}",
                     _mib(pred.peak_bytes - before_step), _mib(traced)))
    print(f"bench model at world {args.world}, cost inputs {args.cost}: {cost}")
    cols = ("system", "units", "resharded", "pred. step ms", "compute", "optimizer", "exposed", "pred. step peak MiB",
            "traced step peak MiB")
    print("\n".join(format_table(cols, rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
