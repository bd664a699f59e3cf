"""Stage 1, plan: what the user asks and what a plan is. Frozen records, printable, built without a process group.

- :mod:`~fsdp_pass.plan.options`, :mod:`~fsdp_pass.plan.schedule`, :mod:`~fsdp_pass.plan.mixed_precision`,
  :mod:`~fsdp_pass.plan.checkpointing`, :mod:`~fsdp_pass.plan.optimizers`: the user's settings, frozen (when
  collectives run, in which dtypes, which units recompute, which optimizer's state a step holds);
- :mod:`~fsdp_pass.plan.layout`, :mod:`~fsdp_pass.plan.sharding`, :mod:`~fsdp_pass.plan.quantized_layout`: how
  each parameter is cut on dim 0 at a world size (takes the module's parameter shapes, gives a
  :class:`ShardingPlan`);
- :mod:`~fsdp_pass.plan.module_tree`, :mod:`~fsdp_pass.plan.unit_policies`, :mod:`~fsdp_pass.plan.plan_units`,
  :mod:`~fsdp_pass.plan.units`: which parameters travel together (takes the module tree and the functional
  forward trace, gives a :class:`UnitPlan`);
- :mod:`~fsdp_pass.plan.trace_arguments`, :mod:`~fsdp_pass.plan.computed_after`: which trace arguments are which
  parameters, and which values the trace computes after each one.

What a plan costs is the next stage, :mod:`fsdp_pass.cost`; how one is chosen, the one after, :mod:`fsdp_pass.search`.
"""
