"""Plan the units of one forward trace: ``plan_units(trace, ...) -> UnitPlan``, before any rewriting.

1. Find where the trace first and last reads each parameter.
2. Ask the unit policy (:mod:`fsdp_pass.plan.unit_policies`) for groups of parameter names.
3. Split a group that mixes dtypes into one unit per dtype (one flat buffer needs one dtype).
4. Decide per unit whether it reshards after forward: ZeRO-2 never; ZeRO-3 every unit except the
   last one the forward gathers, when nothing computes after its last use (the backward then starts with it,
   so freeing it would only mean gathering it again at once). When the forward computes after it (a loss
   computed inside the model: log-softmax, nll, ...), the backward starts with that computation's gradient,
   where the step peaks, and holding the last unit there costs its bytes at the peak: it reshards like the
   others and the backward gathers it again before its first use (:func:`compute_after`). A loss the caller
   computes on the returned outputs (logits) counts the same way, priced as the memory model prices it (taken to
   be a cross-entropy: :func:`caller_loss_bytes`); ``reshard_after_forward`` overrides this.
5. Order units by first use; that is the order of their all-gathers.
6. Mark the units whose activations are checkpointed, and at which level (``checkpoint_activations``, asked per
   unit: :mod:`~fsdp_pass.plan.checkpointing`).
"""

from __future__ import annotations

from dataclasses import replace

import thunder.torch as ltorch

from fsdp_pass.errors import check
from fsdp_pass.plan.checkpointing import checkpoint_level
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.plan.options import FSDPOptions
from fsdp_pass.plan.sharding import ShardingPlan, Strategy
from fsdp_pass.plan.step_summary import caller_loss_bytes
from fsdp_pass.plan.trace_arguments import first_and_last_use
from fsdp_pass.plan.unit_policies import PolicyInput
from fsdp_pass.plan.units import Unit, UnitPlan
from fsdp_pass.predicates import is_bookkeeping, is_float_tensor, is_view_like
from fsdp_pass.report.text import human_bytes

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


# the functional trace's views (Thunder's torch symbols that return views, and its reshapes, views of what is contiguous)
_VIEWS = frozenset(s.id for s in ltorch._syms_returning_views | {ltorch.reshape, ltorch.flatten})


def _is_view(bsym) -> bool:
    return is_view_like(bsym) or bsym.sym.id in _VIEWS


def _result_bytes(bsym) -> int:
    """The bytes of the floating-point tensors ``bsym`` computes, counted over its decomposition's ops (a
    ``cross_entropy``'s log-probabilities and what it takes of them), views left out."""
    if bsym.subsymbols:
        return sum(_result_bytes(s) for s in bsym.subsymbols)
    if is_bookkeeping(bsym) or _is_view(bsym):
        return 0
    return sum(o.numel * o.dtype.bytes for o in bsym.flat_proxy_outs if is_float_tensor(o))


def compute_after(computation, index: int) -> tuple[list[str], int]:
    """The ops of ``computation`` after op ``index`` that compute a floating-point tensor (not a view, a re-layout, a
    shape query, an integer result or bookkeeping), by name in trace order, and the bytes of what they compute:
    what the backward differentiates before it reaches op ``index``, and about what its gradients take."""
    ops = [
        b for b in computation.bound_symbols[index + 1:]
        if not (is_bookkeeping(b) or _is_view(b)) and any(is_float_tensor(o) for o in b.flat_proxy_outs)
    ]
    return [b.sym.name for b in ops], sum(_result_bytes(b) for b in ops)


def keeps_last_unit(after_bytes: int, unit_bytes: int) -> bool:
    """ZeRO-3's rule for the last unit the forward gathers (``reshard_after_forward=None``): keep it gathered into
    the backward unless what the forward computes after its last use (``after_bytes``, :func:`compute_after`: a
    loss computed inside the model; and a loss the caller computes on the outputs, :func:`caller_loss_bytes`)
    outgrows the unit (``unit_bytes``, gathered). The backward starts with those
    ops' gradients, about as large as their results; where they are larger than the unit, the step peaks there
    and a kept unit adds its bytes to that peak, so it reshards and is gathered again before its first use. Where
    they are not (nothing after it; a small loss such as a mean squared error), the unit's own backward holds as
    much (the unit and its gradients), so keeping it raises no peak and saves a gather."""
    return after_bytes <= unit_bytes


def trailing_compute_bytes(computation, param_of_arg: dict[str, str], precision=None) -> int:
    """The bytes :func:`compute_after` counts after the forward's last parameter read, and the caller's loss
    (:func:`caller_loss_bytes`): what the step model prices the default units' last unit against
    (:func:`keeps_last_unit`). :func:`plan_units` asks it of the last unit's last read; the two differ only where a
    parameter of another unit is read after it (tied weights)."""
    uses = first_and_last_use(computation, set(param_of_arg))
    after = compute_after(computation, max(last for _, last in uses.values()))[1] if uses else 0
    return after + caller_loss_bytes(computation, param_of_arg, precision)


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


def _reshard(units: list[Unit], sharding: ShardingPlan, options: FSDPOptions, notes: list[str], computation,
             loss_bytes: int) -> list[Unit]:
    override = options.reshard_after_forward
    strategy = sharding.strategy
    if override is None:
        zero3 = strategy is Strategy.ZERO3 and len(units) > 0
        last = units[-1] if zero3 else None
        after, after_bytes = compute_after(computation, last.last_use) if zero3 else ([], 0)
        gathered_dtype = getattr(options.mixed_precision, "param_dtype", None)  # as the step summary counts it
        unit_bytes = sum(sharding.param(p).nbytes(gathered_dtype) for p in last.params) if zero3 else 0
        keep_last = zero3 and keeps_last_unit(after_bytes + loss_bytes, unit_bytes)
        flags = [zero3 and not (keep_last and i == len(units) - 1) for i in range(len(units))]
        follows = _what_follows(after, after_bytes, loss_bytes)
        if keep_last and not follows:
            notes.append(f"unit {last.name!r} stays gathered after forward: nothing computes after its last use, "
                         "so the backward needs it first")
        elif keep_last:
            notes.append(f"unit {last.name!r} stays gathered after forward: {follows} is no larger than the unit "
                         f"({human_bytes(unit_bytes)}), so the backward's peak is not above it")
        elif zero3:
            notes.append(
                f"unit {last.name!r} reshards after forward although the forward gathers it last: {follows} "
                f"outgrows the unit ({human_bytes(unit_bytes)}); the backward starts with their gradients, "
                "without the unit, and gathers it again before its first use"
            )
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
) -> UnitPlan:
    """Group the parameters the forward trace reads into units, in order of first use.

    ``param_of_arg``: the trace's parameter arguments (:func:`~fsdp_pass.plan.trace_arguments.parameter_names_of_args`);
    ``tree``: the module tree the policy reads (without it every parameter hangs off the root).
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
    loss_bytes = caller_loss_bytes(computation, param_of_arg, options.mixed_precision)
    units = _reshard(units, sharding, options, notes, computation, loss_bytes)
    units = [replace(u, checkpoint=checkpoint_level(options.checkpoint_activations(u))) for u in units]
    return UnitPlan(
        sharding=sharding,
        units=tuple(units),
        policy=getattr(policy, "name", type(policy).__name__),
        notes=tuple(notes),
        arguments=tuple((getattr(a, "name", None), param_of_arg.get(getattr(a, "name", None))) for a in computation.args),
    )
