"""Stage 1c, search: how a plan is chosen. Takes a step summary and the costs of :mod:`fsdp_pass.cost`, gives the
decisions (units, prefetch, resharding, checkpoint levels) with a reason for each, as values the plan stage builds
its :class:`~fsdp_pass.plan.units.UnitPlan` from.

- :mod:`~fsdp_pass.search.unit_search`: which pieces merge into units (``FSDP("auto")`` and the default units);
- :mod:`~fsdp_pass.search.default_units`: the units a user gets without ``units=``, and why;
- :mod:`~fsdp_pass.search.last_unit`: whether ZeRO-3's last unit reshards after forward;
- :mod:`~fsdp_pass.search.auto_plan`: ``FSDP("auto")``'s search, per unit by
  :mod:`~fsdp_pass.search.per_unit_decisions` and :mod:`~fsdp_pass.search.auto_checkpoint`, worded by
  :mod:`~fsdp_pass.search.auto_plan_text`; :mod:`~fsdp_pass.search.auto_options`: that plan as the options the
  other stages read;
- :mod:`~fsdp_pass.search.planned_from`, :mod:`~fsdp_pass.search.decisions`: one plan on every rank (decided once,
  from the step every rank agrees on, kept at later compiles).
"""
