"""HSDP (a 2-D mesh: replicate x shard) on every rank of a gloo RankPool of 4, against one process (module-level
functions, so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.device_mesh import init_device_mesh

import fsdp_pass
from fsdp_pass.op_names import ALL_REDUCE, REDUCE_SCATTER
from fsdp_pass.report.measure import CollectiveBytes
from tests import checkpoint_cases, models, rank_cases, train_cases


def mesh_of(shape: tuple[int, int]):
    return init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))


def _replicas_agree(jm, fsdp) -> float:
    """The largest difference between this rank's shards and those of the ranks holding the same shard."""
    replicate = fsdp.groups.replicate
    if replicate is None:
        return 0.0
    worst = 0.0
    for p in jm.parameters():
        copies = [torch.empty_like(p) for _ in range(dist.get_world_size(replicate))]
        dist.all_gather(copies, p.detach().contiguous(), group=replicate)
        worst = max(worst, max(float((c - p.detach()).abs().max()) for c in copies))
    return worst


def hsdp_parity(model_name: str, strategy: str, shape: tuple[int, int], steps: int = 3, **kwargs):
    """``rank_cases.parity`` on a ``shape`` mesh (replicas, shard size), and what the step looks like there: the
    collectives one step sends (kind, group size), the labels of the backward's collectives, whether the
    replicas' shards are equal after training."""
    mesh = mesh_of(shape)
    out = rank_cases.parity(model_name, strategy, steps=steps, mesh=mesh, keep_model=True, **kwargs)
    jm = out.pop("jm")
    fsdp = fsdp_pass.fsdp_of(jm)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = models.batch(model_name, 2 * world_size, 0)
    with CollectiveBytes() as sent:
        out_ = jm(rank_cases._local(x, rank, world_size))
        models.loss_fn(model_name, out_, rank_cases._local(y, rank, world_size)).backward()
    out["calls"] = sorted({(str(kind), n, size) for (kind, n), size in zip(sent.calls, sent.group_sizes)})
    out["bytes_sent"] = sent.bytes_sent_per_rank
    out["reductions"] = [str(kind) for kind, _ in sent.calls if kind in (REDUCE_SCATTER, ALL_REDUCE)]
    backward = str(fsdp.compiled_step.backward)
    out["labels"] = [line.strip() for line in backward.splitlines() if "[fsdp] unit" in line and "grads" in line]
    out["divide_labels"] = [line.strip() for line in backward.splitlines() if "divide the gradient shard" in line]
    out["replica_diff"] = _replicas_agree(jm, fsdp)
    out["shard_size"] = dist.get_world_size(fsdp.group)
    return out


def hsdp_accumulation(model_name: str, strategy: str, shape: tuple[int, int], **kwargs):
    """``rank_cases.accumulation_parity`` (no_sync against one big batch) on a ``shape`` mesh."""
    return rank_cases.accumulation_parity(model_name, strategy, mesh=mesh_of(shape), **kwargs)


def hsdp_clip(model_name: str, strategy: str, shape: tuple[int, int], **kwargs):
    """``train_cases.clip_parity`` (global-norm clipping against torch's in one process) on a ``shape`` mesh."""
    return train_cases.clip_parity(model_name, strategy, mesh=mesh_of(shape), **kwargs)


def _mesh_kwargs(shape) -> dict:
    return {} if shape is None else {"mesh": mesh_of(shape)}


def hsdp_save_and_continue(shape, model_name: str, strategy: str, optimizer: str, directory: str):
    """``checkpoint_cases.save_and_continue`` on a ``shape`` mesh (None: the default group), and how the checkpoint
    holds each tensor: the row ranges of its chunks (each written once, however many replicas hold it)."""
    out = checkpoint_cases.save_and_continue(model_name, strategy, optimizer, directory, **_mesh_kwargs(shape))
    out["chunks"] = saved_chunks(out["saved_to"])
    return out


def saved_chunks(path: str) -> dict[str, list[tuple[int, int]]]:
    """Each saved tensor's chunks in the checkpoint's metadata, as (first row, rows), and how many stored items."""
    metadata = FileSystemReader(path).read_metadata()
    chunks = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        if hasattr(meta, "chunks") and len(meta.size) > 0:
            chunks[fqn] = sorted((int(c.offsets[0]), int(c.sizes[0])) for c in meta.chunks)
    chunks["stored items"] = len(metadata.storage_data)
    return chunks


def hsdp_resume_and_save(shape, model_name: str, strategy: str, optimizer: str, directory: str, out_dir: str):
    """Resume on a ``shape`` mesh (None: the default group) from a checkpoint saved on another layout
    (``checkpoint_cases.resume_elsewhere``), then save what it trained to ``out_dir`` for the next layout."""
    jm_kwargs = _mesh_kwargs(shape)
    out = checkpoint_cases.resume_elsewhere(model_name, strategy, optimizer, directory, keep=True, **jm_kwargs)
    jm, opt = out.pop("jm"), out.pop("opt")
    fsdp_pass.save_checkpoint(out_dir, jm, opt, step=out["resumed"][0] + 2, extra=out["resumed"][1])
    out["state_at_save"] = checkpoint_cases.whole_state(jm, opt)
    return out
