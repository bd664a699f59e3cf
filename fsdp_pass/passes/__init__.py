"""Pure trace passes: each takes a trace and a plan and returns a new trace (never mutates its input).

Before Thunder's autodiff, on the functional forward trace: :mod:`~fsdp_pass.passes.copy_before_in_place`
(stage 0: in-place ops a gradient flows through read a copy) and (stage 3, insert)
:mod:`~fsdp_pass.passes.insert_unshards`, :mod:`~fsdp_pass.passes.cast_compute`,
:mod:`~fsdp_pass.passes.checkpoint_units`. After lowering, on the final forward and backward traces:
:mod:`~fsdp_pass.passes.schedule_collectives` (stage 5) and :mod:`~fsdp_pass.passes.label_collectives`
(stage 7), with :mod:`~fsdp_pass.passes.collective_groups` (which ops belong to a collective) and
:mod:`~fsdp_pass.passes.units_of_collectives` (which unit each collective gathers or reduces).
"""
