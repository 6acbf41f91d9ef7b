"""The VACE model input built from native VACE conditioning (ComfyUI's `WAN21_Vace.extra_conds`); runs in the worker processes.

Each context j pairs raw `vace_frames[j] [1 or B, 32, R+T, h, w]` with `vace_mask[j] [1 or B, 64, R+T, h, w]`:
both 16-channel latent halves are normalised with the Wan latent mean/std, the mask is appended (96 channels),
and the contexts are stacked on dim 1 -> `vace_context [B, N, 96, R+T, h, w]`.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..config import LATENT_CHANNELS, VACE_FRAME_CHANNELS, VACE_MASK_CHANNELS


def normalise_latents(latents: torch.Tensor, latents_mean: torch.Tensor, latents_std: torch.Tensor) -> torch.Tensor:
    """Raw Wan latents `[B, 16, T, h, w]` -> normalised `(x - mean) / std` per channel.

    Not ``sampling.latents.normalize_latents``: that one multiplies by ``1 / std`` in float32 as diffusers'
    WanPipeline does, this one divides in the latents' dtype as the VACE reference does; each gives
    bit-identical results with its own reference, which the equality tests check."""
    shape = (1, LATENT_CHANNELS, 1, 1, 1)
    mean = latents_mean.to(device=latents.device, dtype=latents.dtype).view(shape)
    std = latents_std.to(device=latents.device, dtype=latents.dtype).view(shape)
    return (latents - mean) / std


def _check_context(index: int, frames: torch.Tensor, mask: torch.Tensor) -> None:
    if frames.ndim != 5 or frames.shape[1] != VACE_FRAME_CHANNELS:
        raise ValueError(f"vace_frames[{index}] must be [B, {VACE_FRAME_CHANNELS}, T, h, w], got shape {tuple(frames.shape)}")
    if mask.ndim != 5 or mask.shape[1] != VACE_MASK_CHANNELS or mask.shape[2:] != frames.shape[2:]:
        raise ValueError(f"vace_mask[{index}] must be [B, {VACE_MASK_CHANNELS}, {', '.join(map(str, frames.shape[2:]))}] "
                         f"to match vace_frames[{index}], got shape {tuple(mask.shape)}")


def _context_batch(frames_list: Sequence[torch.Tensor], masks_list: Sequence[torch.Tensor], batch: Optional[int]) -> int:
    """The batch every context is broadcast to: `batch` if given, else the largest batch given."""
    target = batch if batch is not None else max(t.shape[0] for t in (*frames_list, *masks_list))
    for name, tensors in (("vace_frames", frames_list), ("vace_mask", masks_list)):
        for index, tensor in enumerate(tensors):
            if tensor.shape[0] not in (1, target):
                raise ValueError(f"{name}[{index}] has batch {tensor.shape[0]}; expected 1 or {target}")
    return target


def _one_context(frames: torch.Tensor, mask: torch.Tensor, latents_mean: torch.Tensor,
                 latents_std: torch.Tensor, batch: int) -> torch.Tensor:
    """`[1 or B, 32, ...]` + `[1 or B, 64, ...]` -> `[batch, 96, ...]`, each latent half normalised."""
    halves = [normalise_latents(half, latents_mean, latents_std) for half in frames.split(LATENT_CHANNELS, dim=1)]
    parts = [*halves, mask.to(device=frames.device, dtype=frames.dtype)]
    return torch.cat([part.expand(batch, -1, -1, -1, -1) for part in parts], dim=1)


def vace_model_context(frames_list: Sequence[torch.Tensor], masks_list: Sequence[torch.Tensor],
                       latents_mean: torch.Tensor, latents_std: torch.Tensor,
                       batch: Optional[int] = None) -> torch.Tensor:
    """Raw VACE contexts -> the model's `vace_context [B, N, 96, R+T, h, w]` (B: `batch`, else the largest given)."""
    if not frames_list or len(frames_list) != len(masks_list):
        raise ValueError(f"VACE needs one mask per context and at least one context, got {len(frames_list)} "
                         f"vace_frames and {len(masks_list)} vace_mask")
    for index, (frames, mask) in enumerate(zip(frames_list, masks_list)):
        _check_context(index, frames, mask)
    target = _context_batch(frames_list, masks_list, batch)
    contexts = [_one_context(frames, mask, latents_mean, latents_std, target)
                for frames, mask in zip(frames_list, masks_list)]
    return torch.stack(contexts, dim=1)


def default_vace_context(batch: int, frames: int, h: int, w: int, latents_mean: torch.Tensor,
                         latents_std: torch.Tensor, dtype: torch.dtype = torch.float32,
                         device: Optional[torch.device] = None) -> torch.Tensor:
    """What a VACE model gets with no VACE conditioning (as native): raw zero latents (normalised to -mean/std)
    and a ones mask -> `[batch, 1, 96, frames, h, w]`."""
    raw_zeros = torch.zeros((batch, VACE_FRAME_CHANNELS, frames, h, w), dtype=dtype, device=device)
    ones_mask = torch.ones((batch, VACE_MASK_CHANNELS, frames, h, w), dtype=dtype, device=device)
    return vace_model_context([raw_zeros], [ones_mask], latents_mean, latents_std)
