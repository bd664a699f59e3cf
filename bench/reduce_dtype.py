"""What mixed precision's default reduce dtype changes: each gradient at step 0 with a float32 reduce against one in
the compute dtype (FSDP2's default, ``reduce_dtype=None``), ours and FSDP2's, on the same weights and batches.

``torchrun --standalone --nproc_per_node=2 -m bench.reduce_dtype [llama|qwen2|gpt2|neox]``: the tiny Hugging Face
model of :func:`bench.recipe_parity.build_hf` (2 layers), bfloat16 parameters, ZeRO-3, 2 x 64 tokens per rank.
Rank 0 prints, per pair, the largest difference of a parameter's whole gradient relative to that gradient's largest
element (which parameter) and the median over parameters. docs/precision-offload-accumulation.md quotes the numbers.
"""

from __future__ import annotations

import copy
import sys

import thunder
import torch
import torch.distributed as dist
from fsdp_pass_executors import executors_for
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from bench.recipe_parity import build_hf, decoder_layers
from fsdp_pass import FSDP, MixedPrecision, fsdp_of
from fsdp_pass.shard.global_view import gather_full

BF16, PER_RANK, SEQ = torch.bfloat16, 2, 64


def fsdp2_grads(model, batch, reduce_dtype) -> dict:
    model, mesh = copy.deepcopy(model), init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model(input_ids=batch, labels=batch).loss.backward()
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def our_grads(model, batch, reduce_dtype) -> dict:
    precision = MixedPrecision(BF16, reduce_dtype=reduce_dtype)
    jm = thunder.jit(copy.deepcopy(model), transforms=[FSDP("zero3", mixed_precision=precision)],
                     executors=executors_for("cpu"))
    jm(input_ids=batch, labels=batch).loss.backward()
    fsdp = fsdp_of(jm)
    return {s.name: gather_full(jm.get_parameter(s.name).grad, s.layout, fsdp.group) for s in fsdp.sharding.owners()}


def worst(ours: dict, theirs: dict) -> str:
    rel = {n: float((g.float() - theirs[n].float()).abs().max() / theirs[n].float().abs().max().clamp_min(1e-12))
           for n, g in ours.items()}
    name = max(rel, key=rel.get)
    return f"{rel[name]:.2e} ({name}), median {sorted(rel.values())[len(rel) // 2]:.2e}"


def main(kind: str = "llama") -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_hf(kind, 2)
    ids = torch.randint(0, model.config.vocab_size, (world * PER_RANK, SEQ), generator=torch.Generator().manual_seed(1))
    batch = ids[rank * PER_RANK:(rank + 1) * PER_RANK]
    theirs = {dtype: fsdp2_grads(model, batch, dtype) for dtype in (torch.float32, None)}
    ours = {dtype: our_grads(model, batch, dtype) for dtype in (torch.float32, None)}
    if rank == 0:
        print(f"{kind}, world {world}, step 0, each gradient's largest difference / its largest element")
        print("FSDP2, reduce None vs float32:", worst(theirs[None], theirs[torch.float32]))
        print("ours,  reduce None vs float32:", worst(ours[None], ours[torch.float32]))
        print("ours vs FSDP2, float32 reduce:", worst(ours[torch.float32], theirs[torch.float32]))
        print("ours vs FSDP2, None reduce:   ", worst(ours[None], theirs[None]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
