"""Process-group arithmetic shared by every parallel plan; runs in the workers (and benchmark ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this process's index) in ``group``; (1, 0) when torch.distributed is not initialised.

    ``None`` follows torch's convention: the default (world) group when a process group is initialised.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group")
    return dist.get_world_size(group), rank


def optional_group_size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Like :func:`group_size_and_rank`, but ``None`` means "not split along this dimension": (1, 0)."""
    return (1, 0) if group is None else group_size_and_rank(group)


def all_gather_nested(tensor: torch.Tensor, groups: list[dist.ProcessGroup | None], dim: int) -> torch.Tensor:
    """``tensor`` (this rank's slice) joined with every rank's along ``dim``, one group after another, innermost
    first: each group's ranks hold neighbouring pieces of what the gathers before it joined. ``None`` groups (no
    split along that dimension) are skipped."""
    for group in groups:
        if group is None:
            continue
        pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, tensor.contiguous(), group=group)
        tensor = torch.cat(pieces, dim=dim)
    return tensor
