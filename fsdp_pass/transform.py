"""``FSDP``: the Thunder transform. A thin adapter from Thunder's hooks onto the pipeline.

Thunder calls, in order:
  1. ``transform_module`` once, when ``thunder.jit`` is given the transform: shard the parameters
     (:func:`~fsdp_pass.shard.module.shard_module`), giving a :class:`~fsdp_pass.shard.module.ShardedModel`;
  2. ``transform_traces_pre_prologue`` at each compile, on the prologue and the functional forward trace:
     stages 1-3 of :mod:`fsdp_pass.pipeline` (plan the units, shard the prologue's checks, insert the
     gathers). Thunder then derives the backward from ``unshard_unit``'s gradient rule (the
     reduce-scatters) and lowers both traces;
  3. ``transform_trace_post_optimization`` on the final forward and backward traces: stages 5-7 of the
     pipeline (schedule, verify, label).

Each compile is kept as one frozen :class:`~fsdp_pass.compiled_step.CompiledStep` (``compiled_step``), which
``explain()`` and ``overlap_report()`` read.
"""

from __future__ import annotations

import itertools

import thunder
from thunder.core.trace import TraceTag
from thunder.core.transform_common import Transform
from thunder.extend import get_executor

from fsdp_pass.compiled_step import CompiledStep
from fsdp_pass.errors import check
from fsdp_pass.models.hf_tracing import trace_hf_models
from fsdp_pass.op_names import COMM_EXECUTOR
from fsdp_pass.ops.grad_accumulation import GradAccumulators
from fsdp_pass.pipeline import finish_lowered, rewrite_forward
from fsdp_pass.search.decisions import settle_planning_inputs
from fsdp_pass.plan.layout import shard_tensor
from fsdp_pass.plan.options import DEFAULT_TIMEOUT, FSDPOptions
from fsdp_pass.cost.price_plan import price_plan
from fsdp_pass.plan.schedule import DEFAULT_SCHEDULE, Schedule
from fsdp_pass.plan.sharding import Strategy
from fsdp_pass.cost.step_model import Prediction
from fsdp_pass.report.explain import Explanation, explain_step
from fsdp_pass.report.overlap import OverlapReport, step_overlap
from fsdp_pass.shard.forward_inputs import check_and_cast_inputs_on_call
from fsdp_pass.shard.global_view import gather_full
from fsdp_pass.shard.input_checks import positional_names
from fsdp_pass.shard.module import ShardedModel, check_not_sharded_yet, check_process_group, place_shard, shard_module
from fsdp_pass.shard.original import remember_shards, restore_from_shards
from fsdp_pass.shard.requires_grad import follow_requires_grad
from fsdp_pass.shard.state_dict import load_model_state_dict, model_state_dict
from fsdp_pass.verify.ranks_arrive import ranks_arrive

_ORDINALS = itertools.count()


class FSDP(Transform):
    """Fully sharded data parallel as a trace pass.

    Args:
        strategy: ``"zero2"`` (keep gathered parameters for the backward), ``"zero3"`` (free them
            after forward, gather again in the backward), or ``"auto"``: the auto planner
            (:mod:`fsdp_pass.search.auto_plan`) chooses the units, which of them reshard after forward, the
            prefetch depth and, where the budget needs it, which units checkpoint their activations (selective
            or full), for the fastest predicted step within ``memory_budget``; ``explain()`` prints the plan
            with a reason per decision.
        memory_budget: with ``"auto"``: bytes per rank the step may peak at (``"20GiB"``, ``"512MiB"``, or an
            int); default: the CUDA device's memory, no bound on the CPU.
        cost: with ``"auto"``, or ``units=`` left out: what collectives and compute cost (:mod:`fsdp_pass.cost.cost_model`): a name in
            ``DEFAULTS`` (``"h100-nvlink"``, ``"cpu-gloo"``), a ``CostInputs``, or ``fsdp_pass.cost.probe.probe(...)``'s
            result measured on your ranks; default: the defaults of the device the step computes on.
        optimizer: with ``"auto"``: what steps the shards, for its state's bytes and its time
            (:mod:`fsdp_pass.plan.optimizers`): ``"adamw"`` (default), ``"adam"``, ``"sgd-momentum"``, ``"sgd"``.
        process_group: the group to shard over; the default group if None.
        mesh: instead of ``process_group``, a torch ``DeviceMesh``: 1-D, the group to shard over; 2-D
            ``("replicate", "shard")``, hybrid sharding (HSDP, :mod:`fsdp_pass.shard.mesh`): each parameter is
            sharded over the shard dim (e.g. the GPUs of a node) and replicated over the replicate dim; the
            gradient shards are all-reduced over the replicate dim after their reduce-scatter.
        device: where shards live; default: the model's device, else ``cuda:LOCAL_RANK``.
        broadcast_from: a rank (of every rank of the model) whose initial parameters and buffers every rank
            takes; None keeps
            each rank's own (then ranks must have initialized identically, e.g. the same seed).
        units: the unit policy (see :mod:`fsdp_pass.plan.unit_policies`): ``"blocks"`` (one unit per
            repeated block, the rest grouped by where the trace uses them), ``"per_parameter"``, a
            list of modules / classes / names (explicit units), or ``BySize(max_bytes)``. Left out, the step
            model chooses them at the first compile (:mod:`fsdp_pass.search.default_units`): the units with the
            fastest predicted step for the other options as given whose predicted peak is no higher than
            ``"blocks"``'s (memory first), starting from ``"blocks"``'s, from a step every rank agrees on
            (:mod:`fsdp_pass.search.planned_from`); ``explain()`` prints the choice, why, and what it traded.
        reshard_after_forward: None (ZeRO-3: every unit but the last one gathered, that one too where
            what the forward computes after it, e.g. a loss inside the model, outgrows it; ZeRO-2: none),
            True, False, or a function ``Unit -> bool`` deciding per unit.
        schedule: when collectives are issued and waited (:class:`~fsdp_pass.plan.schedule.Schedule`):
            the default prefetches one unit ahead; an int is the prefetch depth; None keeps the
            order Thunder's lowering produced.
        checkpoint_activations: recompute units' activations in the backward instead of saving them
            (activation checkpointing, :mod:`~fsdp_pass.passes.checkpoint_units`): False, True (every
            unit), or a function ``Unit -> bool``. The recomputation reads the gather the backward
            does anyway: no extra collective.
        mixed_precision: None (no casts), a :class:`~fsdp_pass.plan.mixed_precision.MixedPrecision`, or a
            dtype (gather and compute in it, reduce in float32), with FSDP2's semantics at the root: the module is
            traced with its parameters in ``param_dtype`` and the model's floating inputs cast to it, its own casts
            as written, its buffers as defined (where and why it differs from FSDP2:
            :mod:`~fsdp_pass.plan.mixed_precision`). The shards stay in their dtype: the optimizer steps on them as
            master weights. float16 wants :class:`fsdp_pass.GradScaler`.
        offload_to: None, or the device the shards, their gradients (and so the optimizer state) live
            on between uses, e.g. ``"cpu"``: each unit's shards are copied to ``device`` right before
            its all-gather and its gradient shard is copied back after its reduce-scatter.
        release_original_parameters: replace the original module's full tensors with meta tensors
            once sharded, so each rank holds 1/N of the parameters.
        verify_ranks: at every step, beside its first collective and before any other, check that every rank's
            step issues the same collectives (ranks may run inputs of different shapes; each compiles its own
            variant); where they differ, every rank raises an FSDPError naming the first that differs.
        timeout: seconds (or a ``timedelta``) a collective helper (``full_state_dict``, ``get_state_dict``,
            ``save_checkpoint``, ...) waits for every rank to call it before raising an FSDPError that names
            the ranks that did not; default 10 minutes.
        check_finite: check each parameter (this rank's shard), each block's output and each parameter's
            gradient (before and after the reduce-scatter) for NaN and inf inside the step; a forward or a
            backward that produced one raises at its end the same ``NonFiniteError`` (an FSDPError) on every
            rank naming the first parameter (its module and unit) or output in execution order, which check saw
            it and the rank; with an enabled ``fsdp_pass.GradScaler`` the gradients' overflow is left to it
            (:mod:`fsdp_pass.ops.finite_checks`). False (default): no op in the traces.
    """

    def __init__(
        self,
        strategy: Strategy | str = Strategy.ZERO2,
        *,
        process_group=None,
        mesh=None,
        device=None,
        broadcast_from: int | None = None,
        units=None,
        reshard_after_forward=None,
        schedule: Schedule | int | None = DEFAULT_SCHEDULE,
        checkpoint_activations=False,
        mixed_precision=None,
        offload_to=None,
        release_original_parameters: bool = True,
        verify_ranks: bool = True,
        timeout=DEFAULT_TIMEOUT,
        memory_budget=None,
        cost=None,
        check_finite: bool = False,
        optimizer=None,
    ):
        self.options = FSDPOptions.resolve(
            strategy,
            units=units,
            reshard_after_forward=reshard_after_forward,
            schedule=schedule,
            checkpoint_activations=checkpoint_activations,
            mixed_precision=mixed_precision,
            offload_to=offload_to,
            verify_ranks=verify_ranks,
            timeout=timeout,
            memory_budget=memory_budget,
            cost=cost,
            check_finite=check_finite,
            optimizer=optimizer,
        )
        self.process_group = process_group
        self.mesh = mesh
        # the n-th FSDP made in this process: every rank makes its transforms in the same order, so this names
        # the same model on every rank (collective helpers count their calls per model: verify.ranks_arrive)
        self.ordinal = next(_ORDINALS)
        self.device = device
        self.broadcast_from = broadcast_from
        self.release_original_parameters = release_original_parameters
        self.accumulators = GradAccumulators()  # what no_sync() accumulates for this transform's model
        self.model: ShardedModel | None = None  # set once the module is sharded
        self.compiled_step: CompiledStep | None = None  # the latest compile
        self.first_plan = None  # the first compile's UnitPlan: the step every rank planned from, and the decisions
        self.argument_names: tuple[str, ...] = ()  # the module's positional forward parameters

    def __repr__(self) -> str:
        if self.options.auto is not None:
            return "fsdp_pass.FSDP(strategy='auto')"
        return f"fsdp_pass.FSDP(strategy={self.strategy.value!r}, units={self.options.unit_policy.name!r})"

    @property
    def strategy(self) -> Strategy:
        return self.options.strategy

    @property
    def sharding(self):
        """The :class:`~fsdp_pass.plan.sharding.ShardingPlan` (None before the module is sharded)."""
        return None if self.model is None else self.model.sharding

    @property
    def group(self):
        """The process group the parameters are sharded over (None before the module is sharded)."""
        return None if self.model is None else self.model.group

    @property
    def groups(self):
        """The :class:`~fsdp_pass.shard.mesh.RankGroups`: the shard group, with HSDP the replicate group too."""
        return None if self.model is None else self.model.groups

    @property
    def unit_plan(self):
        """The :class:`~fsdp_pass.plan.units.UnitPlan` of the latest compile (None before the first)."""
        return None if self.compiled_step is None else self.compiled_step.plan

    def transform_module(self, model) -> None:
        groups = check_process_group(self.process_group, self.mesh)
        check_not_sharded_yet(model)
        ensure_comm_executor(model)
        trace_hf_models(model)  # transformers 5: output capture, causal mask (models/hf_tracing.py)
        restore_from_shards(model)  # jitted again: start from the weights an earlier FSDP jit holds
        self.model = shard_module(
            model,
            groups,
            self.strategy,
            self.device,
            self.broadcast_from,
            self.release_original_parameters,
            self.options.offload_to,
            self.options.mixed_precision,
        )
        self.argument_names = positional_names(model._model)  # for the errors that name an input
        check_and_cast_inputs_on_call(model, self)
        # every rank plans from rank 0's cost inputs and budget
        self.options = settle_planning_inputs(self.options, self.model.device, groups.everyone)
        model._fsdp_pass_plan = self.model.sharding
        remember_shards(model, self.model, released=self.release_original_parameters)
        install_state_dict_methods(model, self)
        follow_requires_grad(model, self)

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        grad_sync = (self.accumulators.mode(), self.accumulators)
        prologue_trace, computation_trace, plan, options = rewrite_forward(
            prologue_trace, computation_trace, self.model, self.options, grad_sync, kwargs.get("executors_list", ()),
            self.argument_names, self.first_plan,
        )
        self.compiled_step = CompiledStep(plan, options)
        if self.first_plan is None:  # every rank's first compile: later ones (one rank's alone) keep its decisions
            self.first_plan = plan
        return prologue_trace, computation_trace, epilogue_trace

    def transform_trace_post_optimization(self, computation_trace, **kwargs):
        phase = "backward" if TraceTag.BACKWARD in computation_trace.tags else "forward"
        step = self.compiled_step
        trace, units = finish_lowered(
            computation_trace, phase, step.plan, step.options, self.model.groups.everyone, step_key=step.key,
            scope=self.scope, forward=step.forward if phase == "backward" else None,
        )
        self.compiled_step = step.with_final_trace(phase, trace, units, lowered=computation_trace)
        return trace

    @property
    def scope(self) -> str:
        """This model's name among the models of this process, the same on every rank (its per-step state)."""
        return f"model{self.ordinal}"

    def overlap_report(self) -> OverlapReport:
        """Per collective of the latest compile: issue, wait, and the compute that runs in between."""
        return step_overlap(self._compiled("overlap_report()"))

    def explain(self, optimizer="adam") -> Explanation:
        """The per-unit table and per-rank totals of the latest compile (:func:`fsdp_pass.explain`)."""
        return explain_step(self._compiled("explain()"), optimizer=optimizer)

    def predict_step(self, cost=None) -> Prediction:
        """The step model's step time and peak for the latest compile's plan (:func:`fsdp_pass.predict_step`)."""
        step = self._compiled("predict_step()")
        return price_plan(step.plan, step.options, cost, self.model.device)

    def arrive(self, what: str) -> None:
        """Return once every rank of the group has called the collective helper ``what`` on this model; an
        FSDPError naming the ranks that did not after ``FSDP(timeout=...)`` (:mod:`fsdp_pass.verify.ranks_arrive`)."""
        ranks_arrive(what, self.model.groups.everyone, self.options.timeout, scope=self.scope)

    def _compiled(self, what: str) -> CompiledStep:
        check(
            self.compiled_step is not None and self.compiled_step.forward is not None,
            f"{what} reads the traces of a compiled step, and this model has not been compiled yet.",
            "Run one step first (loss = jm(x); loss.backward()), or use `python -m fsdp_pass explain` for a dry run.",
        )
        return self.compiled_step

    # state dicts through ThunderModule.load_original_state_dict / original_state_dict
    def transform_state_dict_for_submodule(self, model, submodule_name, state_dict):
        prefix = f"{submodule_name}." if submodule_name else ""
        sharding, out = self.model.sharding, {}
        for k, v in state_dict.items():
            name = prefix + k
            if name in sharding:
                v = shard_tensor(v.to(self.model.device), sharding.param(name).layout, sharding.rank)
                v = place_shard(v, self.model.placed_on, self.model.device)
            out[k] = v
        return out

    def reverse_transform_state_dict_for_submodule(self, model, submodule_name, state_dict):
        prefix = f"{submodule_name}." if submodule_name else ""
        sharding, out = self.model.sharding, {}
        for k, v in state_dict.items():
            name = prefix + k
            if name in sharding:  # gathered from the shard itself (the state dict holds its DTensor view)
                spec = sharding.param(name)
                v = gather_full(model.get_parameter(spec.shard_of), spec.layout, self.model.group)
            out[k] = v
        return out


def install_state_dict_methods(thunder_module, fsdp: FSDP) -> None:
    """``jm.state_dict()`` and ``jm.load_state_dict()`` of the sharded model, as FSDP2's are: every key of the
    original module (tied names too), each parameter a DTensor ``Shard(0)`` view of its shard, so
    ``torch.distributed.checkpoint`` saves the whole model (Thunder's own methods give each rank's padded
    shard under the full name: a checkpoint of them holds one rank's rows). ``load_state_dict`` takes that
    form, or full tensors of the full shapes. ``original_state_dict()`` gathers the full tensors, every key
    (Thunder's names a root module's own parameters ``".name"``). The last two are collective: every rank
    arrives first (:meth:`FSDP.arrive`). Each reads the transform's current ``ShardedModel``."""

    def state_dict(*, destination=None, prefix: str = "", keep_vars: bool = False):
        out = {} if destination is None else destination
        out.update({prefix + k: v for k, v in model_state_dict(thunder_module, fsdp.model).items()})
        return out

    def original_state_dict(*, destination=None, prefix: str = "", keep_vars: bool = False):
        out = {} if destination is None else destination
        fsdp.arrive("jm.original_state_dict()")
        out.update({prefix + k: v for k, v in model_state_dict(thunder_module, fsdp.model, full=True).items()})
        return out

    def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
        check(
            not assign,
            "load_state_dict(assign=True) would replace the shards by the loaded tensors.",
            "Load with assign=False (the default): values are cut to this rank's shard and copied into it.",
        )
        fsdp.arrive("jm.load_state_dict()")
        load_model_state_dict(thunder_module, fsdp.model, state_dict, form="any", strict=strict)

    # instance attributes: this ThunderModule only, not the class every jitted model shares
    thunder_module.state_dict = state_dict
    thunder_module.load_state_dict = load_state_dict
    thunder_module.original_state_dict = original_state_dict


def ensure_comm_executor(thunder_module) -> None:
    """Put ``fsdp_comm`` first in the executor list the module compiles with (it is there already when the
    list came from ``executors_for``): the pass's collectives, their pack and unpack ops and the
    accumulation ops run on it, and only there are they kept out of fusion regions."""
    comm = get_executor(COMM_EXECUTOR)  # registered when fsdp_pass is imported (fsdp_pass/__init__.py)
    compile_data = thunder.compile_data(thunder_module)
    others = tuple(ex for ex in compile_data.executors_list if ex is not comm)
    compile_data.executors_list = (comm, *others)
