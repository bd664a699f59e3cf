"""Plan the units of one forward trace: ``plan_units(trace, ...) -> UnitPlan``, before any rewriting.

1. Find where the trace first and last reads each parameter.
2. Ask the unit policy (:mod:`fsdp_pass.plan.unit_policies`) for groups of parameter names.
3. Split a group that mixes dtypes into one unit per dtype (one flat buffer needs one dtype).
4. Decide per unit whether it reshards after forward: ZeRO-2 never; ZeRO-3 every unit, and the last one the
   forward gathers too only where the step model predicts a lower step peak for resharding it than for keeping
   it gathered into the backward (:mod:`~fsdp_pass.search.last_unit`; a tie keeps it: a gather saved), priced on the
   step summary every rank plans from (``summary``: :mod:`~fsdp_pass.search.planned_from`). Where the model cannot
   price the units (no summary, a unit that splits a piece, a schedule it does not follow) a byte rule decides
   (:func:`keeps_last_unit`): the last unit reshards where what the forward computes after its last use (the
   summary's :func:`~fsdp_pass.plan.computed_after.bytes_after_last_read`) outgrows it. ``reshard_after_forward``
   overrides both.
5. Order units by first use; that is the order of their all-gathers.
6. Mark the units whose activations are checkpointed, and at which level (``checkpoint_activations``, asked per
   unit: :mod:`~fsdp_pass.plan.checkpointing`).
"""

from __future__ import annotations

from dataclasses import replace

from fsdp_pass.errors import check
from fsdp_pass.plan.checkpointing import checkpoint_level
from fsdp_pass.plan.computed_after import compute_after
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.sharding import ShardingPlan, Strategy
from fsdp_pass.cost.candidate_costs import Candidate
from fsdp_pass.search.last_unit import last_unit, starts_of
from fsdp_pass.cost.step_summary import StepSummary
from fsdp_pass.plan.trace_arguments import first_and_last_use
from fsdp_pass.plan.unit_policies import PolicyInput
from fsdp_pass.plan.units import Unit, UnitPlan
from fsdp_pass.text import human_bytes

_DTYPE_SHORT = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}


def _short(dtype) -> str:
    return _DTYPE_SHORT.get(str(dtype), str(dtype).replace("torch.", ""))


def _split_by_dtype(groups, sharding: ShardingPlan, notes: list[str]):
    out = []
    for name, params in groups:
        by_dtype: dict = {}
        for p in params:
            by_dtype.setdefault(sharding.param(p).dtype, []).append(p)
        if len(by_dtype) == 1:
            out.append((name, tuple(params)))
            continue
        notes.append(
            f"unit {name!r} mixes dtypes ({', '.join(_short(d) for d in by_dtype)}): split into one unit per dtype"
        )
        out.extend((f"{name}[{_short(d)}]", tuple(ps)) for d, ps in by_dtype.items())
    return out


def keeps_last_unit(after_bytes: int, unit_bytes: int) -> bool:
    """ZeRO-3's rule for the last unit the forward gathers where the step model cannot price the units
    (``reshard_after_forward=None``; else :mod:`~fsdp_pass.search.last_unit` decides): keep it gathered into
    the backward unless what the forward computes after its last use (``after_bytes``, :func:`~fsdp_pass.plan.computed_after.compute_after`: a
    loss computed inside the model; and a loss the caller computes on the outputs, :func:`caller_loss_bytes`)
    outgrows the unit (``unit_bytes``, gathered). The backward starts with those
    ops' gradients, about as large as their results; where they are larger than the unit, the step peaks there
    and a kept unit adds its bytes to that peak, so it reshards and is gathered again before its first use. Where
    they are not (nothing after it; a small loss such as a mean squared error), the unit's own backward holds as
    much (the unit and its gradients), so keeping it raises no peak and saves a gather."""
    return after_bytes <= unit_bytes


def _what_follows(after: list[str], after_bytes: int, loss_bytes: int) -> str:
    """The plan note's words for what the backward differentiates before the last unit's first use."""
    shown = list(dict.fromkeys(after))
    ops = f"{', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}"
    parts = [f"what computes after its last use ({ops}, {human_bytes(after_bytes)})"] if after else []
    if loss_bytes:
        parts.append("the loss the caller computes on the returned outputs (taken to be a cross-entropy, as the "
                     f"memory model prices it: log-probabilities and their gradient, {human_bytes(loss_bytes)})")
    total = f" ({human_bytes(after_bytes + loss_bytes)} together)" if len(parts) > 1 else ""
    return " and ".join(parts) + total


def _priced_template(units: list[Unit], options: FSDPOptions, levels: list[str], summary):
    """``units`` as the step model's candidate over ``summary``'s pieces (its resharding left to decide), or None
    where the model cannot price them: no summary, a unit that is not a run of whole pieces, a schedule that is not
    prefetch depths with the kept units first."""
    s = options.schedule
    if summary is None or s is None or s.max_unused_bytes is not None or not s.kept_units_first:
        return None
    starts = starts_of(summary, [u.params for u in units])
    if starts is None:
        return None
    own = dict(s.prefetch_by_unit)
    depths = tuple(own.get(u.name, s.prefetch) for u in units)
    return Candidate(starts, (True,) * len(units), s.prefetch, options.offload_to is not None,
                     depths if any(d != s.prefetch for d in depths) else (),
                     tuple(levels) if any(lv != "none" for lv in levels) else ())


def _last_unit_by_bytes(units, sharding, options, computation, summary, notes) -> bool:
    """The rule where the step model cannot price the units (:func:`keeps_last_unit`): whether the last unit
    reshards, with its note. Its bytes are the ``summary``'s (the step every rank plans from) where it has one, the
    op names this trace's."""
    last = units[-1]
    after, after_bytes = compute_after(computation, last.last_use)
    planned = summary.bytes_after(last.params) if summary is not None else None
    after_bytes = after_bytes if planned is None else planned
    loss_bytes = summary.loss_bytes if summary is not None else 0
    gathered_dtype = getattr(options.mixed_precision, "param_dtype", None)  # as the step summary counts it
    unit_bytes = sum(sharding.param(p).nbytes(gathered_dtype) for p in last.params)
    keep_last = keeps_last_unit(after_bytes + loss_bytes, unit_bytes)
    follows = _what_follows(after, after_bytes, loss_bytes)
    if keep_last and not follows:
        notes.append(f"unit {last.name!r} stays gathered after forward: nothing computes after its last use, "
                     "so the backward needs it first")
    elif keep_last:
        notes.append(f"unit {last.name!r} stays gathered after forward: {follows} is no larger than the unit "
                     f"({human_bytes(unit_bytes)}), so the backward's peak is not above it")
    else:
        notes.append(
            f"unit {last.name!r} reshards after forward although the forward gathers it last: {follows} "
            f"outgrows the unit ({human_bytes(unit_bytes)}); the backward starts with their gradients, "
            "without the unit, and gathers it again before its first use"
        )
    return not keep_last


def _reshard(units: list[Unit], sharding: ShardingPlan, options: FSDPOptions, notes: list[str], computation,
             summary, levels: list[str]) -> list[Unit]:
    override = options.reshard_after_forward
    if override is None:
        zero3 = sharding.strategy is Strategy.ZERO3 and len(units) > 0
        template = _priced_template(units, options, levels, summary) if zero3 else None
        if template is not None:
            decided = last_unit(summary, template, [u.name for u in units])
            last_reshards = decided.reshards
            verdict = ("reshards after forward although the forward gathers it last" if last_reshards
                       else "stays gathered after forward")
            notes.append(f"unit {units[-1].name!r} {verdict}: {decided.why()}")
        elif zero3:
            last_reshards = _last_unit_by_bytes(units, sharding, options, computation, summary, notes)
        flags = [zero3 and (i < len(units) - 1 or last_reshards) for i in range(len(units))]
    elif isinstance(override, bool):
        flags = [override] * len(units)
    else:
        check(callable(override), f"reshard_after_forward={override!r} is not a bool or a function of a unit.",
              "Pass None (the strategy decides), True, False, or a function Unit -> bool.")
        flags = [bool(override(u)) for u in units]
    return [replace(u, reshard_after_forward=f) for u, f in zip(units, flags)]


def policy_input(computation, param_of_arg: dict[str, str], sharding: ShardingPlan, tree: ModuleTree | None):
    """What a unit policy sees: the tree, the parameters in order of first use, their uses and sizes."""
    uses_of_arg = first_and_last_use(computation, set(param_of_arg))
    uses = {param_of_arg[a]: u for a, u in uses_of_arg.items()}
    order = tuple(sorted(uses, key=lambda p: uses[p][0]))
    return PolicyInput(
        tree=tree if tree is not None else ModuleTree.flat(p.name for p in sharding.params),
        order=order,
        first_use={p: uses[p][0] for p in order},
        nbytes={p: sharding.param(p).nbytes() for p in order},
    ), uses


def plan_units(
    computation,
    param_of_arg: dict[str, str],
    sharding: ShardingPlan,
    options: FSDPOptions,
    tree: ModuleTree | None = None,
    summary: StepSummary | None = None,
) -> UnitPlan:
    """Group the parameters the forward trace reads into units, in order of first use.

    ``param_of_arg``: the trace's parameter arguments (:func:`~fsdp_pass.plan.trace_arguments.parameter_names_of_args`);
    ``tree``: the module tree the policy reads (without it every parameter hangs off the root); ``summary``: the
    step summary the plan is decided from (:mod:`~fsdp_pass.cost.step_summary`; in the pipeline the one every rank
    plans from, :mod:`~fsdp_pass.search.planned_from`, whatever this trace's shapes), from which the step model
    decides ZeRO-3's last unit (where the model cannot price the units, the byte rule :func:`keeps_last_unit` does
    from its bytes; without it, from this trace's, with the caller's loss taken as none).
    """
    policy = options.unit_policy
    inp, uses = policy_input(computation, param_of_arg, sharding, tree)
    groups = policy.groups(inp)
    placed = [p for _, ps in groups for p in ps]
    check(sorted(placed) == sorted(inp.order),
          f"Unit policy {type(policy).__name__} did not place every used parameter exactly once.",
          "A custom policy's groups() must return each parameter of PolicyInput.order in one group.")
    notes: list[str] = []
    unused = [s.name for s in sharding.params if s.name not in uses]
    if unused:
        notes.append(f"{len(unused)} parameter(s) not read by this forward, never gathered: {', '.join(unused[:4])}"
                     + (", ..." if len(unused) > 4 else ""))

    units = [
        Unit(name, params, False, min(uses[p][0] for p in params), max(uses[p][1] for p in params))
        for name, params in _split_by_dtype(groups, sharding, notes)
    ]
    units.sort(key=lambda u: u.first_use)
    levels = [checkpoint_level(options.checkpoint_activations(u)) for u in units]
    units = _reshard(units, sharding, options, notes, computation, summary, levels)
    units = [replace(u, checkpoint=level) for u, level in zip(units, levels)]
    return UnitPlan(
        sharding=sharding,
        units=tuple(units),
        policy=getattr(policy, "name", type(policy).__name__),
        notes=tuple(notes),
        arguments=tuple((getattr(a, "name", None), param_of_arg.get(getattr(a, "name", None))) for a in computation.args),
    )
