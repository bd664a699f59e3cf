"""Which ranks share the shards and which hold copies: the groups of ``FSDP(process_group=...)`` or ``FSDP(mesh=...)``.

``resolve_groups(process_group, mesh) -> RankGroups``

- nothing: the default group shards every parameter (plain FSDP);
- a process group, or a 1-D ``DeviceMesh``: that group shards every parameter;
- a 2-D ``DeviceMesh`` (HSDP, hybrid sharding), dims ``("replicate", "shard")`` in that order: a
  parameter is sharded over the ranks of one "shard" row (e.g. the GPUs of a node) and each row holds a whole
  copy, so the ranks of a "replicate" column (the same position in every node) hold the same shard. The
  forward's and ZeRO-3's backward gathers stay in the shard group; the gradients are reduce-scattered in the
  shard group, then their shards all-reduced over the replicate group, and divided by the whole world.

Every rank of the mesh (``world``) takes part in what concerns them all: the per-step collective check, the
collective helpers' arrival, broadcasting initial weights and state dicts, rank 0's file work, the distributed
checkpoint (whose planner writes each shard once: the replicas' DTensor views, each on its own shard group's
1-D mesh, cover the same rows, and torch.distributed.checkpoint drops the duplicates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_pass.errors import check, fail

REPLICATE, SHARD = "replicate", "shard"


@dataclass(frozen=True)
class RankGroups:
    """The process groups one FSDP model uses."""

    shard: object  # the ProcessGroup each parameter is sharded over
    replicate: object | None = None  # HSDP: the ProcessGroup of the ranks holding the same shard; None: no copies
    world: object | None = None  # every rank of the mesh (None: the shard group is all of it)
    mesh: DeviceMesh | None = None  # the user's 2-D mesh (HSDP); None otherwise

    @property
    def everyone(self):
        """The group of every rank of the model (checks, arrival, broadcasts, rank 0's file work)."""
        return self.shard if self.world is None else self.world

    @property
    def replicas(self) -> int:
        """How many whole copies of the model the ranks hold (1 without HSDP)."""
        return 1 if self.replicate is None else dist.get_world_size(self.replicate)

    @property
    def ranks(self) -> int:
        """Every rank of the model: the ranks whose gradients one step averages."""
        return dist.get_world_size(self.shard) * self.replicas

    def describe(self) -> str:
        """``"shard group (4 ranks) x replicate group (2 ranks)"``, or ``"4 ranks"`` without HSDP."""
        shard = dist.get_world_size(self.shard)
        if self.replicate is None:
            return f"{shard} ranks"
        return f"shard group ({shard} ranks) x replicate group ({self.replicas} ranks)"


def _check_dim_order(mesh: DeviceMesh) -> None:
    """Dim 0 replicates and dim 1 shards (the order FSDP2 takes too); names, if any, must say so."""
    names = mesh.mesh_dim_names
    check(
        names is None or tuple(names) == (REPLICATE, SHARD) or set(names) != {REPLICATE, SHARD},
        f"FSDP(mesh=...) has its dims named {tuple(names) if names else None}: the shard dim comes first.",
        "Build the mesh with the replicate dim first: init_device_mesh(device_type, (replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard')).",
    )


def resolve_groups(process_group=None, mesh=None) -> RankGroups:
    """The groups from ``FSDP(process_group=..., mesh=...)`` (at most one of the two)."""
    check(
        process_group is None or mesh is None,
        "FSDP was given both process_group= and mesh=.",
        "Pass one: mesh=init_device_mesh(...) (1-D: FSDP over it; 2-D ('replicate', 'shard'): HSDP), or a "
        "process_group.",
    )
    if mesh is None:
        return RankGroups(process_group if process_group is not None else dist.group.WORLD)
    check(
        isinstance(mesh, DeviceMesh),
        f"FSDP(mesh={mesh!r}) is not a torch DeviceMesh.",
        "Make one with torch.distributed.device_mesh.init_device_mesh(device_type, (replicas, shard_size), "
        "mesh_dim_names=('replicate', 'shard')), or pass process_group= instead.",
    )
    if mesh.ndim == 1:
        return RankGroups(mesh.get_group())
    if mesh.ndim != 2:
        fail(
            f"FSDP(mesh=...) has {mesh.ndim} dimensions {tuple(mesh.shape)}; FSDP shards over one and replicates "
            "over at most one more.",
            "Pass a 1-D mesh (FSDP), or a 2-D mesh ('replicate', 'shard') for HSDP; for tensor or pipeline "
            "parallelism on other dims, pass the sub-mesh FSDP runs on, e.g. mesh['replicate', 'shard'].",
        )
    _check_dim_order(mesh)
    if mesh.shape[0] == 1:  # one copy: plain FSDP over the shard dim
        return RankGroups(mesh.get_group(1))
    ranks = mesh.mesh.flatten().tolist()
    world = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(sorted(ranks))
    return RankGroups(mesh.get_group(1), mesh.get_group(0), world, mesh)
