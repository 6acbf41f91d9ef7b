"""Process groups for one worker, derived from ParallelConfig.

After ``torch.distributed`` is initialised, every rank builds the same ``DeviceMesh`` over
``MESH_DIMS = (dp, cfg, ulysses, ring, tp)`` (torch's own mesh, which creates one process group per
dimension) and wraps it in a :class:`ParallelContext`: what the engine and the parallel plans ask for
(this rank's coordinates, the group along a dimension, its size).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..config import MESH_DIMS, ParallelConfig, rank_coordinates


@dataclass
class ParallelContext:
    """One rank's view of the pool: its coordinates and the process group along each mesh dimension."""

    config: ParallelConfig
    rank: int
    device: torch.device
    mesh: DeviceMesh | None = None
    coords: dict[str, int] = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.config.world

    def size(self, dim: str) -> int:
        return self.config.mesh_shape[MESH_DIMS.index(dim)]

    def coord(self, dim: str) -> int:
        return self.coords[dim]

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """The group of ranks that differ from this one only along ``dim`` (None when the pool is one rank)."""
        if dim not in MESH_DIMS:
            raise KeyError(f"unknown mesh dimension {dim!r}; valid: {', '.join(MESH_DIMS)}")
        return self.mesh.get_group(dim) if self.mesh is not None else None

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.group("tp")

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        return self.group("ulysses")

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        return self.group("ring")

    @property
    def cfg_group(self) -> dist.ProcessGroup | None:
        return self.group("cfg")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group("dp")

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    config: ParallelConfig, rank: int, device: torch.device, store: dist.Store, timeout_s: float,
    collective_timeout_s: float | None = None,
) -> ParallelContext:
    """Join the default process group through ``store`` and build the mesh; every rank must call this.

    ``timeout_s`` bounds joining (ranks may start seconds apart); ``collective_timeout_s`` (default: the same)
    then bounds every collective of every group, so a rank waiting on a stuck peer fails instead of hanging."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        store=store,
        rank=rank,
        world_size=config.world,
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    mesh = init_device_mesh(device.type, config.mesh_shape, mesh_dim_names=MESH_DIMS)
    if collective_timeout_s is not None:
        set_collective_timeout(mesh, collective_timeout_s)
    return ParallelContext(config=config, rank=rank, device=device, mesh=mesh, coords=rank_coordinates(config, rank))


def set_collective_timeout(mesh: DeviceMesh, seconds: float) -> None:
    """Give the default group and every mesh group the same collective timeout."""
    timeout = datetime.timedelta(seconds=seconds)
    dist.distributed_c10d._set_pg_timeout(timeout)  # torch's only setter for an existing group (private name)
    for dim in MESH_DIMS:
        dist.distributed_c10d._set_pg_timeout(timeout, mesh.get_group(dim))
