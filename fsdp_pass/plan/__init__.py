"""Stage 1, plan: decide before rewriting anything. Frozen records, printable, built without a process group.

- :mod:`~fsdp_pass.plan.layout`, :mod:`~fsdp_pass.plan.sharding`: how each parameter is cut on dim 0 at a
  world size (takes the module's parameter shapes, gives a :class:`ShardingPlan`);
- :mod:`~fsdp_pass.plan.module_tree`, :mod:`~fsdp_pass.plan.unit_policies`,
  :mod:`~fsdp_pass.plan.plan_units`, :mod:`~fsdp_pass.plan.units`: which parameters travel together (takes the
  module tree and the functional forward trace, gives a :class:`UnitPlan`);
- :mod:`~fsdp_pass.plan.trace_arguments`: which trace arguments are which parameters;
- :mod:`~fsdp_pass.plan.schedule`, :mod:`~fsdp_pass.plan.mixed_precision`: the user's settings for when
  collectives run and in which dtypes;
- :mod:`~fsdp_pass.plan.cost_model`: what a collective costs (latency and bandwidth, fitted to what
  :mod:`fsdp_pass.plan.probe` measures) and the device's compute rate;
- ``FSDP("auto")``: :mod:`~fsdp_pass.plan.step_summary` (the trace cut into pieces: bytes, FLOPs,
  activations, tallied op by op by :mod:`~fsdp_pass.plan.op_tally`), :mod:`~fsdp_pass.plan.step_model` (a
  candidate plan's predicted step time and peak, from its units' own costs in
  :mod:`~fsdp_pass.plan.candidate_costs`),
  :mod:`~fsdp_pass.plan.auto_plan` (the search, and a reason per decision: the units by
  :mod:`~fsdp_pass.plan.unit_search`, which the default units of :mod:`~fsdp_pass.plan.default_units` use too,
  the rest by :mod:`~fsdp_pass.plan.per_unit_decisions`, worded by :mod:`~fsdp_pass.plan.auto_plan_text`),
  :mod:`~fsdp_pass.plan.auto_options` (the plan as the options the other stages read);
  :mod:`~fsdp_pass.plan.price_plan` (the step model on any compiled plan, hand-written ones too:
  ``fsdp_pass.predict_step``).
"""
