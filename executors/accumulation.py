"""The ``fsdp_comm`` executor's implementations of the gradient-accumulation ops of :mod:`fsdp_pass.ops.grad_accumulation`.

In a printed execution trace they read ``fsdp_accumulate_unsharded_grads(flat, key)`` (add to the
accumulator, no output) and ``fsdp_add_accumulated_grads(flat, key)`` (the accumulator plus ``flat``,
after which the accumulator is empty).
"""

from __future__ import annotations

from fsdp_pass_executors.collectives import comm_ex
from thunder.core import prims

from fsdp_pass.ops import grad_accumulation as ga

accumulate_op = comm_ex.register_operator(
    "fsdp_accumulate_unsharded_grads",
    meta=ga.accumulate_unsharded_grads.meta,
    fn=ga.accumulate_impl,
    tags=(prims.OpTags.DONT_DCE,),
)
add_accumulated_op = comm_ex.register_operator(
    "fsdp_add_accumulated_grads", meta=ga.add_accumulated_grads.meta, fn=ga.add_accumulated_impl
)
comm_ex.register_implementation(ga.accumulate_unsharded_grads, accumulate_op)
comm_ex.register_implementation(ga.add_accumulated_grads, add_accumulated_op)
