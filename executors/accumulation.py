"""The ``fsdp_comm`` executor's implementations of the gradient-accumulation ops of :mod:`fsdp_pass.ops.grad_accumulation`.

In a printed execution trace they read ``fsdp_accumulate_unsharded_grads(flat, unit, accumulators)`` (add
to the unit's accumulator, no output) and ``fsdp_add_accumulated_grads(flat, unit, accumulators)`` (the
accumulator plus ``flat``, after which the accumulator is empty); ``accumulators`` is the FSDP transform's
:class:`~fsdp_pass.ops.grad_accumulation.GradAccumulators`.
"""

from __future__ import annotations

from fsdp_pass_executors.collectives import comm_ex
from thunder.core import prims

from fsdp_pass.ops import grad_accumulation as ga
from fsdp_pass.op_names import ACCUMULATE_OP, ADD_ACCUMULATED_OP

accumulate_op = comm_ex.register_operator(
    ACCUMULATE_OP, meta=ga.accumulate_unsharded_grads.meta, fn=ga.accumulate_impl, tags=(prims.OpTags.DONT_DCE,)
)
add_accumulated_op = comm_ex.register_operator(
    ADD_ACCUMULATED_OP, meta=ga.add_accumulated_grads.meta, fn=ga.add_accumulated_impl
)
comm_ex.register_implementation(ga.accumulate_unsharded_grads, accumulate_op)
comm_ex.register_implementation(ga.add_accumulated_grads, add_accumulated_op)
