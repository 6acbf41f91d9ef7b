"""Model-agnostic patch-parallel executor: split an input into tile tasks, run them across ranks, merge on rank 0.

The caller supplies three functions:

* ``split(x) -> (tasks, grid)``: cuts ``x`` into :class:`TileTask` s (each with a workload) plus an opaque grid spec;
* ``exec_fn(task) -> Tensor``: computes one tile;
* ``merge({coord: tensor}, grid) -> Tensor``: assembles the tile results.

Every rank of the group calls :func:`run_patch_parallel` with the same ``x`` and runs ``split`` itself (it is
deterministic and cheap), so no input is communicated. Tasks are spread over ranks by workload, each rank runs its
own tiles, results travel to group rank 0 (shapes first, then one flat buffer per rank), rank 0 merges, and the merged
tensor is optionally broadcast back to every rank. With one rank (or no process group) the same split / exec / merge
runs locally, which is the reference the parallel result equals.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.distributed as dist

from .groups import group_size_and_rank
from torch import Tensor

logger = logging.getLogger(__name__)

Coord = tuple[int, ...]
SplitFn = Callable[[Any], "tuple[list[TileTask], Any]"]
ExecFn = Callable[["TileTask"], Tensor]
MergeFn = Callable[[dict[Coord, Tensor], Any], Tensor]


@dataclass
class TileTask:
    """One unit of patch work: ``inputs`` are the tensors ``exec_fn`` needs; ``workload`` is its relative cost."""

    id: int
    coord: Coord
    inputs: tuple[Tensor, ...]
    workload: float


def assign_by_workload(tasks: list[TileTask], world: int) -> list[list[TileTask]]:
    """Greedy longest-processing-time assignment of ``tasks`` to ``world`` ranks.

    Tasks are taken heaviest first (ties by id) and each goes to the rank with the least total workload so far (ties to
    the lowest rank), so the result depends only on the task list. Each rank's list is returned in task-id order.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1 rank, got {world}")
    ids = [task.id for task in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError(f"tile task ids must be unique, got {sorted(ids)}")
    bad = [task.id for task in tasks if not task.workload >= 0]
    if bad:
        raise ValueError(f"tile task workloads must be non-negative numbers; tasks {bad} are not")

    loads = [0.0] * world
    buckets: list[list[TileTask]] = [[] for _ in range(world)]
    for task in sorted(tasks, key=lambda t: (-t.workload, t.id)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        buckets[rank].append(task)
        loads[rank] += task.workload
    return [sorted(bucket, key=lambda t: t.id) for bucket in buckets]


def effective_patch_size(requested: int, pool_size: int) -> int:
    """Number of ranks to use for patch parallelism: ``requested``, capped at the pool size with a logged note."""
    if requested < 1:
        raise ValueError(f"vae_patch must be a positive number of ranks, got {requested}")
    if pool_size < 1:
        raise ValueError(f"pool size must be at least 1, got {pool_size}")
    if requested > pool_size:
        logger.warning(
            "vae_patch=%d is larger than the pool (%d ranks); using vae_patch=%d", requested, pool_size, pool_size
        )
        return pool_size
    return requested


def run_patch_parallel(
    x: Any,
    split: SplitFn,
    exec_fn: ExecFn,
    merge: MergeFn,
    *,
    group: dist.ProcessGroup | None = None,
    broadcast: bool = False,
) -> Tensor | None:
    """Split ``x``, execute the tiles across ``group`` and merge on its rank 0.

    ``group=None`` means the default process group when one is initialised, else a single local rank. Every rank of
    the group must call this with the same ``x``. Returns the merged tensor on group rank 0, and on every rank when
    ``broadcast`` is set; other ranks get ``None``.
    """
    world, rank = group_size_and_rank(group)
    tasks, grid = split(x)
    _check_unique_coords(tasks)
    my_tasks = assign_by_workload(tasks, world)[rank]
    local = {task.coord: exec_fn(task) for task in my_tasks}

    if world == 1:
        return merge(local, grid)

    device = _device_of(x, local)
    gathered = _gather_results_to_rank0(local, group, rank, device)
    merged = merge(gathered, grid) if rank == 0 else None
    if broadcast:
        merged = _broadcast_from_rank0(merged, group, rank, device)
    return merged


def _global_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    # send/recv/broadcast take global ranks in every torch version we support (group_dst/group_src are newer).
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def _check_unique_coords(tasks: list[TileTask]) -> None:
    coords = [task.coord for task in tasks]
    if len(set(coords)) != len(coords):
        raise ValueError("split produced tile tasks with duplicate grid coordinates")


def _gather_results_to_rank0(
    local: dict[Coord, Tensor], group: dist.ProcessGroup | None, rank: int, device: torch.device
) -> dict[Coord, Tensor]:
    """Bring every rank's tile results to group rank 0: metadata as objects, then one flat tensor per rank.

    Tiles differ in shape (edge tiles are smaller), which tensor gather cannot express; sending each rank's tiles as a
    single flattened buffer keeps the message count at one per rank.
    """
    meta = _describe(local)
    all_meta: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(meta, all_meta, dst=_global_rank(group, 0), group=group)

    if rank != 0:
        if local:
            flat = torch.cat([t.reshape(-1) for t in local.values()])
            dist.send(flat, dst=_global_rank(group, 0), group=group)
        return {}

    gathered = dict(local)
    for src, src_meta in enumerate(all_meta):  # type: ignore[arg-type]
        if src == 0 or not src_meta["tiles"]:
            continue
        flat = torch.empty(src_meta["numel"], dtype=src_meta["dtype"], device=device)
        dist.recv(flat, src=_global_rank(group, src), group=group)
        gathered.update(_unflatten(flat, src_meta["tiles"]))
    return gathered


def _describe(local: dict[Coord, Tensor]) -> dict[str, Any]:
    dtypes = {t.dtype for t in local.values()}
    if len(dtypes) > 1:
        raise TypeError(f"exec_fn must return one dtype for all tiles, got {sorted(map(str, dtypes))}")
    return {
        "tiles": [(coord, tuple(t.shape)) for coord, t in local.items()],
        "numel": sum(t.numel() for t in local.values()),
        "dtype": dtypes.pop() if dtypes else None,
    }


def _unflatten(flat: Tensor, tiles: list[tuple[Coord, tuple[int, ...]]]) -> dict[Coord, Tensor]:
    out: dict[Coord, Tensor] = {}
    offset = 0
    for coord, shape in tiles:
        numel = int(torch.Size(shape).numel())
        out[coord] = flat[offset : offset + numel].view(shape)
        offset += numel
    return out


def _broadcast_from_rank0(
    merged: Tensor | None, group: dist.ProcessGroup | None, rank: int, device: torch.device
) -> Tensor:
    header: list[Any] = [(tuple(merged.shape), merged.dtype) if merged is not None else None]
    dist.broadcast_object_list(header, src=_global_rank(group, 0), group=group)
    shape, dtype = header[0]
    buffer = merged.contiguous() if merged is not None else torch.empty(shape, dtype=dtype, device=device)
    dist.broadcast(buffer, src=_global_rank(group, 0), group=group)
    return buffer


def _device_of(x: Any, local: dict[Hashable, Tensor]) -> torch.device:
    """Device for receive buffers: that of the local results, else of the input, else the CPU."""
    for t in local.values():
        return t.device
    if isinstance(x, Tensor):
        return x.device
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], Tensor):
        return x[0].device
    return torch.device("cpu")
