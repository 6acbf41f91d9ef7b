"""Frame splitting for per-frame encoders: the frames of one call split over the ranks that run the same
forward, the per-frame outputs all-gathered; runs in the workers (and benchmark ranks).

Wan 2.2 Animate's motion encoder reduces every 512x512 face frame to one vector with a stack of convolutions
(the bulk of the Animate modules' FLOPs). The ranks of one guidance pass (its tp, Ulysses and ring ranks) all
receive the same face video, so instead of each encoding all of it, each encodes a contiguous slice of the frames
and the (small) vectors are all-gathered, giving every rank the whole sequence for what follows (the face
encoder's temporal part, replicated, and the face adapter blocks). Each frame is encoded independently, so the
result equals the unsplit one up to float reassociation of the batched convolutions.

Applied from outside the model as two hooks on the encoder module (a pre-hook that keeps this rank's frames, a
hook that gathers the outputs); the model code is unchanged. Ranks are ordered as in the mesh: tp varies
fastest, then ring, then Ulysses, so slice ``(u * ring + r) * tp + t`` belongs to the rank at (u, r, t), and the
gathers run innermost group first. Uneven counts are cut as the token split cuts them (``SequenceShard``): every
rank takes ``ceil(N / ranks)`` frames (the last ones fewer, possibly none) and pads its output to that many rows
before the gather; the padding is cut after it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .context_parallel import SequenceShard
from .groups import all_gather_nested, optional_group_size_and_rank

__all__ = ["FrameSplit", "apply_frame_split", "frame_split_plan"]

# Animate's encoders whose work is per frame: [N, ...] -> [N, ...], each row from its own input row.
PER_FRAME_MODULES = ("motion_encoder",)


def frame_split_plan(model: nn.Module) -> tuple[str, ...]:
    """The paths of ``model``'s per-frame encoders (none for models without them)."""
    return tuple(path for path in PER_FRAME_MODULES if hasattr(model, path))


class FrameSplit:
    """One rank's frame split over ``groups`` (innermost first, e.g. tp, ring, Ulysses); groups of one rank or
    ``None`` are left out."""

    def __init__(self, groups: list[dist.ProcessGroup | None]):
        self.groups: list[dist.ProcessGroup] = []
        self.index, stride = 0, 1
        for group in groups:
            size, rank = optional_group_size_and_rank(group)
            if size > 1:
                self.groups.append(group)
                self.index += rank * stride
                stride *= size
        self.ranks = stride
        self._pending: list[SequenceShard] = []
        self._handles: list[Any] = []

    def _keep_local_frames(self, module, args):
        frames, *rest = args
        frame_slice = SequenceShard(valid_len=frames.shape[0], index=self.index, count=self.ranks)
        self._pending.append(frame_slice)
        start, stop = frame_slice.bounds()
        return (frames[start:stop], *rest)

    def _gather_frames(self, module, args, output: torch.Tensor) -> torch.Tensor:
        frame_slice = self._pending.pop()
        missing = frame_slice.local_len - output.shape[0]
        if missing:
            output = torch.cat([output, output.new_zeros(missing, *output.shape[1:])])
        return all_gather_nested(output, self.groups, dim=0)[: frame_slice.valid_len]

    def install(self, model: nn.Module, paths: tuple[str, ...]) -> None:
        for path in paths:
            module = model.get_submodule(path)
            self._handles.append(module.register_forward_pre_hook(self._keep_local_frames))
            self._handles.append(module.register_forward_hook(self._gather_frames))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()


def apply_frame_split(model: nn.Module, groups: list[dist.ProcessGroup | None]) -> nn.Module:
    """Split the frames of ``model``'s per-frame encoders over ``groups`` (innermost first); in place, returns the
    model. Every rank of the groups must call it and then run every forward together (as the tp and context
    plans require anyway). One rank in all, or a model without such encoders, is left untouched."""
    paths = frame_split_plan(model)
    split = FrameSplit(groups)
    if split.ranks == 1 or not paths:
        return model
    if getattr(model, "frame_split", None) is not None:
        raise RuntimeError("the frame split is already applied to this model")
    split.install(model, paths)
    model.frame_split = split
    return model
