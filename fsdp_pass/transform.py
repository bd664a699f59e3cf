"""``FSDP``: the Thunder transform. A thin adapter from Thunder's hooks onto the pure passes.

Thunder calls, in order:
  1. ``transform_module`` once, when ``thunder.jit`` is given the transform: shard the parameters
     (:func:`~fsdp_pass.shard.module.shard_module`), producing the :class:`ShardingPlan`;
  2. ``transform_traces_pre_prologue`` at each compile, on the functional forward trace: plan the
     units (:func:`~fsdp_pass.plan.plan_units.plan_units`), insert the gathers
     (:func:`~fsdp_pass.passes.insert_unshards.insert_unshards`) and fix the prologue's checks
     (:func:`~fsdp_pass.shard.prologue.shard_prologue`). Thunder then derives the backward
     from ``unshard_unit``'s gradient rule (the reduce-scatters) and lowers both traces;
  3. ``transform_trace_post_optimization`` on the final forward and backward traces: place the
     collectives for overlap (:func:`~fsdp_pass.passes.schedule_collectives.schedule_collectives`),
     check that all ranks issue the same collectives (:mod:`fsdp_pass.verify`) and label each
     collective with its unit (:func:`~fsdp_pass.passes.label_collectives.annotate_collectives`).
"""

from __future__ import annotations

from thunder.core.trace import TraceTag
from thunder.core.transform_common import Transform

from fsdp_pass.ops import grad_accumulation
from fsdp_pass.errors import check, fail
from fsdp_pass.plan.layout import shard_tensor
from fsdp_pass.plan.mixed_precision import resolve_mixed_precision
from fsdp_pass.shard.module import check_not_sharded_yet, check_process_group, place_shard, shard_module
from fsdp_pass.plan.module_tree import ModuleTree
from fsdp_pass.report.overlap import OverlapReport, overlap_report
from fsdp_pass.passes.label_collectives import annotate_collectives
from fsdp_pass.passes.units_of_collectives import units_of_collectives
from fsdp_pass.passes.cast_compute import cast_compute
from fsdp_pass.passes.checkpoint_units import checkpoint_units
from fsdp_pass.passes.insert_unshards import insert_unshards
from fsdp_pass.plan.trace_arguments import parameter_names_of_args
from fsdp_pass.passes.schedule_collectives import schedule_collectives
from fsdp_pass.shard.prologue import shard_prologue
from fsdp_pass.plan.sharding import Strategy, parse_strategy
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE, Schedule, resolve_schedule
from fsdp_pass.shard.state_dict import gather_full
from fsdp_pass.plan.unit_policies import resolve_policy
from fsdp_pass.plan.plan_units import plan_units
from fsdp_pass.verify.collective_lifetimes import check_collective_lifetimes
from fsdp_pass.verify.same_collectives_on_all_ranks import check_same_collectives_on_all_ranks


def _checkpoint_predicate(spec):
    if isinstance(spec, bool):
        return lambda unit: spec
    check(
        callable(spec),
        f"checkpoint_activations={spec!r} is neither a bool nor a function of a unit.",
        "Pass True (every unit), False, or a function Unit -> bool, e.g. lambda u: u.name.startswith('layers.').",
    )
    return spec


class FSDP(Transform):
    """Fully sharded data parallel as a trace pass.

    Args:
        strategy: ``"zero2"`` (keep gathered parameters for the backward) or ``"zero3"`` (free them
            after forward, gather again in the backward).
        process_group: the group to shard over; the default group if None.
        device: where shards live; default: the model's device, else ``cuda:LOCAL_RANK``.
        broadcast_from: a rank whose initial parameters and buffers every rank takes; None keeps
            each rank's own (then ranks must have initialized identically, e.g. the same seed).
        units: the unit policy (see :mod:`fsdp_pass.plan.unit_policies`): ``"blocks"`` (one unit per
            repeated block, the rest grouped by where the trace uses them), ``"per_parameter"``, a
            list of modules / classes / names (explicit units), or ``BySize(max_bytes)``.
        reshard_after_forward: None (ZeRO-3: every unit but the last one gathered; ZeRO-2: none),
            True, False, or a function ``Unit -> bool`` deciding per unit.
        schedule: when collectives are issued and waited (:class:`~fsdp_pass.plan.schedule.Schedule`):
            the default prefetches one unit ahead; an int is the prefetch depth; None keeps the
            order Thunder's lowering produced.
        checkpoint_activations: recompute units' activations in the backward instead of saving them
            (activation checkpointing, :mod:`~fsdp_pass.passes.checkpoint_units`): False, True (every
            unit), or a function ``Unit -> bool``. The recomputation reads the gather the backward
            does anyway: no extra collective.
        mixed_precision: None (no casts), a :class:`~fsdp_pass.plan.mixed_precision.MixedPrecision`, or a
            dtype (gather and compute in it, reduce in float32). The shards stay in their dtype: the
            optimizer steps on them as master weights.
        offload_to: None, or the device the shards, their gradients (and so the optimizer state) live
            on between uses, e.g. ``"cpu"``: each unit's shards are copied to ``device`` right before
            its all-gather and its gradient shard is copied back after its reduce-scatter.
        release_original_parameters: replace the original module's full tensors with meta tensors
            once sharded, so each rank holds 1/N of the parameters.
        verify_ranks: at each compile, check that every rank issues the same collectives.
    """

    def __init__(
        self,
        strategy: Strategy | str = Strategy.ZERO2,
        *,
        process_group=None,
        device=None,
        broadcast_from: int | None = None,
        units="blocks",
        reshard_after_forward=None,
        schedule: Schedule | int | None = DEFAULT_SCHEDULE,
        checkpoint_activations=False,
        mixed_precision=None,
        offload_to=None,
        release_original_parameters: bool = True,
        verify_ranks: bool = True,
    ):
        self.strategy = parse_strategy(strategy)
        self.process_group = process_group
        self.device = device
        self.broadcast_from = broadcast_from
        self.units = resolve_policy(units)
        self.reshard_after_forward = reshard_after_forward
        self.schedule = resolve_schedule(schedule)
        self.checkpoint_activations = _checkpoint_predicate(checkpoint_activations)
        self.checkpointed_units: tuple[str, ...] = ()  # latest compile
        self.mixed_precision = resolve_mixed_precision(mixed_precision)
        self.offload_to = offload_to
        self.shard_device = None  # where the shards live: offload_to, else device
        self.accumulation_key = grad_accumulation.new_key()  # no_sync's accumulators of this transform
        self.release_original_parameters = release_original_parameters
        self.verify_ranks = verify_ranks
        self.group = None
        self.sharding = None
        self.tree = None  # the module tree the unit policy reads
        self.unit_plan = None  # the plan of the latest compile
        self._param_of_arg: dict[str, str] = {}  # latest compile: argument name -> parameter name
        self._arg_order: list[str | None] = []  # latest compile: argument names, in order
        self._final_traces: dict = {}  # latest compile: phase -> final trace
        self._unit_of_collective: dict[str, str] = {}  # latest compile: collective output name -> unit

    def __repr__(self) -> str:
        return f"fsdp_pass.FSDP(strategy={self.strategy.value!r}, units={self.units.name!r})"

    def transform_module(self, model) -> None:
        self.group = check_process_group(self.process_group)
        check_not_sharded_yet(model)
        self.tree = ModuleTree.of(model._model)
        self.sharding, self.device, self.shard_device = shard_module(
            model,
            self.group,
            self.strategy,
            self.device,
            self.broadcast_from,
            self.release_original_parameters,
            self.offload_to,
        )
        model._fsdp_pass_plan = self.sharding

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        arg_params = parameter_names_of_args(prologue_trace, computation_trace)
        self._param_of_arg = arg_params
        self._arg_order = [getattr(a, "name", None) for a in computation_trace.args]
        self.unit_plan = plan_units(
            computation_trace, arg_params, self.sharding, self.units, self.tree, self.reshard_after_forward
        )
        grad_sync = (grad_accumulation.mode_of(self.accumulation_key), self.accumulation_key)
        if grad_sync[0] != grad_accumulation.REDUCE:
            check_accumulation_executor(kwargs.get("executors_list", ()))
        computation_trace = insert_unshards(
            computation_trace,
            self.unit_plan,
            arg_params,
            self.group,
            precision=self.mixed_precision,
            compute_device=None if self.offload_to is None else str(self.device),
            grad_sync=grad_sync,
        )
        computation_trace = cast_compute(computation_trace, self.mixed_precision, arg_params)
        self.checkpointed_units = tuple(u.name for u in self.unit_plan.units if self.checkpoint_activations(u))
        computation_trace = checkpoint_units(computation_trace, self.checkpointed_units)
        prologue_trace = shard_prologue(prologue_trace, self.sharding, self.shard_device, grad_sync)
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace, **kwargs):
        phase = "backward" if TraceTag.BACKWARD in computation_trace.tags else "forward"
        found = units_of_collectives(computation_trace, self.unit_plan, self._param_of_arg, self._arg_order)
        if self.schedule is not None:
            kept = frozenset(
                name
                for name, (unit, kind) in found.items()
                if phase == "forward" and kind == "all-gather" and not unit.reshard_after_forward
            )
            computation_trace = schedule_collectives(computation_trace, self.schedule, kept)
        check_collective_lifetimes(computation_trace)
        if self.verify_ranks:
            check_same_collectives_on_all_ranks(computation_trace, phase, self.group)
        self._unit_of_collective.update({name: unit.name for name, (unit, _) in found.items()})
        self._final_traces[phase] = annotate_collectives(computation_trace, self.unit_plan, found)
        return self._final_traces[phase]

    def overlap_report(self) -> OverlapReport:
        """Per collective of the latest compile: issue, wait, and the compute that runs in between."""
        check(
            "forward" in self._final_traces,
            "overlap_report() reads the traces of a compiled step, and none was compiled yet.",
            "Call the jitted model once (and .backward() for the backward rows) first.",
        )
        return overlap_report(
            self._final_traces["forward"], self._final_traces.get("backward"), self._unit_of_collective
        )

    def explain(self, optimizer="adam"):
        """The per-unit table and per-rank totals of the latest compile (:func:`fsdp_pass.report.explain.explain`)."""
        from fsdp_pass.report.explain import explain

        return explain(self, optimizer=optimizer)

    # state dicts through ThunderModule.load_original_state_dict / original_state_dict
    def transform_state_dict_for_submodule(self, model, submodule_name, state_dict):
        prefix = f"{submodule_name}." if submodule_name else ""
        out = {}
        for k, v in state_dict.items():
            name = prefix + k
            if name in self.sharding:
                v = shard_tensor(v.to(self.device), self.sharding.param(name).layout, self.sharding.rank)
                v = place_shard(v, self.shard_device, self.device)
            out[k] = v
        return out

    def reverse_transform_state_dict_for_submodule(self, model, submodule_name, state_dict):
        prefix = f"{submodule_name}." if submodule_name else ""
        out = {}
        for k, v in state_dict.items():
            name = prefix + k
            if name in self.sharding:
                v = gather_full(v, self.sharding.param(name).layout, self.group)
            out[k] = v
        return out


def check_accumulation_executor(executors) -> None:
    """The accumulation ops run on the ``fsdp_comm`` executor only: say so before lowering fails."""
    check(
        any(getattr(ex, "name", None) == "fsdp_comm" for ex in executors),
        "Gradient accumulation (fsdp_pass.no_sync) needs the fsdp_comm executor, and it is not in executors=.",
        "Jit with executors=fsdp_pass_executors.executors_for(device) (or put fsdp_pass_executors.comm_ex first).",
    )


def fsdp_of(jitted) -> FSDP:
    """The :class:`FSDP` transform a model was jitted with (an error saying what to pass otherwise)."""
    for t in getattr(jitted, "_lc_transforms", ()):
        if isinstance(t, FSDP):
            return t
    fail(
        f"This model ({type(jitted).__name__}) was not compiled with fsdp_pass.FSDP.",
        "Pass the model returned by thunder.jit(model, transforms=[FSDP(...)]).",
    )
