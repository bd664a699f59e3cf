"""One spelling for every op the pass inserts or reads, and for each kind of collective.

The symbol ids of the ops this project defines, the names its executor (``fsdp_comm``) registers for the
ops it runs, and the names Thunder's own torch executor gives the same prims. Predicates
(:mod:`fsdp_pass.predicates`), the executors (:mod:`fsdp_pass_executors`) and the error messages read
them from here, so a rename happens in one place.
"""

from __future__ import annotations

from enum import Enum


class CollectiveKind(str, Enum):
    """The collectives a step issues, as reports and labels name them."""

    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE = CollectiveKind

# the executor that runs this project's collectives and accumulation ops
COMM_EXECUTOR = "fsdp_comm"
# the executor that runs attention on CPU tensors with torch's CPU flash kernel, and its two ops
CPU_ATTENTION_EXECUTOR = "cpu_attention"
CPU_ATTENTION_OP = "cpu_flash_attention"
CPU_ATTENTION_BACKWARD_OP = "cpu_flash_attention_backward"

# ops this project defines (symbol ids)
UNSHARD_UNIT = "fsdp_pass.unshard_unit"
ACCUMULATE_UNSHARDED_GRADS = "fsdp_pass.accumulate_unsharded_grads"
ADD_ACCUMULATED_GRADS = "fsdp_pass.add_accumulated_grads"
CHECK_GRAD_SYNC = "fsdp_pass.check_grad_sync"
PACK_SHARDS = "fsdp_pass.pack_shards"
UNPACK_GATHERED = "fsdp_pass.unpack_gathered"
VIEW_SHARDS = "fsdp_pass.view_shards"
PACK_GRADS = "fsdp_pass.pack_grads"
UNPACK_GRAD_SHARD = "fsdp_pass.unpack_grad_shard"
QUANTIZE_SHARD = "fsdp_pass.quantize_shard"
DEQUANTIZE_GATHERED = "fsdp_pass.dequantize_gathered"
CHECK_SAME_COLLECTIVES = "fsdp_pass.check_same_collectives"
EXCHANGE_STEP_DIGEST = "fsdp_pass.exchange_step_digest"
AWAIT_STEP_DIGESTS = "fsdp_pass.await_step_digests"
CLEAR_FINITE_FLAGS = "fsdp_pass.clear_finite_flags"
CHECK_FINITE = "fsdp_pass.check_finite"
RAISE_IF_NONFINITE = "fsdp_pass.raise_if_nonfinite"

# what fsdp_comm names the ops it runs (as printed in the execution traces)
ALL_GATHER_OP = "fsdp_all_gather"
REDUCE_SCATTER_OP = "fsdp_reduce_scatter"
ALL_REDUCE_OP = "fsdp_all_reduce"
WAIT_OP = "fsdp_wait"
ACCUMULATE_OP = "fsdp_accumulate_unsharded_grads"
ADD_ACCUMULATED_OP = "fsdp_add_accumulated_grads"
PACK_SHARDS_OP = "fsdp_pack_shards"
UNPACK_GATHERED_OP = "fsdp_unpack_gathered"
VIEW_SHARDS_OP = "fsdp_view_shards"
PACK_GRADS_OP = "fsdp_pack_grads"
UNPACK_GRAD_SHARD_OP = "fsdp_unpack_grad_shard"
QUANTIZE_SHARD_OP = "fsdp_quantize_shard"
DEQUANTIZE_GATHERED_OP = "fsdp_dequantize_gathered"

# what Thunder's torch executor names the same distributed prims
TORCH_ALL_GATHER_OP = "torch_all_gather_prim_impl"
TORCH_REDUCE_SCATTER_OP = "torch_reduce_scatter_prim_impl"
TORCH_ALL_REDUCE_OP = "torch_all_reduce_prim_impl"
TORCH_WAIT_OP = "torch_wait_prim_impl"
