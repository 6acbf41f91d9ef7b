"""Pixel formats between the VAE and the user; runs in the workers.

Pixels inside the workers are VAE-space tensors [B, 3, F, H, W] in -1..1; frames (what users save and what
ComfyUI's IMAGE holds) are [F, H, W, 3] float32 in 0..1. Frames a VAE encodes are first cut to its spatial factor
around the centre, as native VAEEncode cuts them.
"""

from __future__ import annotations

import torch


def pixels_to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] in -1..1 -> [B*F, H, W, 3] float32 in 0..1."""
    frames = ((pixels.float().clamp(-1.0, 1.0) + 1.0) / 2.0).permute(0, 2, 3, 4, 1)
    return frames.reshape(-1, *frames.shape[2:]).contiguous().cpu()


def frames_to_pixels(frames: torch.Tensor) -> torch.Tensor:
    """[F, H, W, 3] in 0..1 -> [1, 3, F, H, W] in -1..1 (channels beyond 3 are dropped, as ComfyUI does)."""
    if frames.ndim != 4 or frames.shape[-1] < 3:
        raise ValueError(f"expected frames [F, H, W, 3], got shape {list(frames.shape)}")
    return (frames[..., :3].float() * 2.0 - 1.0).permute(3, 0, 1, 2).unsqueeze(0).contiguous()


def centre_crop(frames: torch.Tensor, multiple: int) -> torch.Tensor:
    """Frames [F, H, W, C] with each size cut to a multiple of ``multiple`` around the centre (offset: half the
    remainder, rounded down), as native VAEEncode cuts them to the VAE's spatial factor."""
    height, width = frames.shape[1:3]
    small = [f"{name} {size} is smaller than the VAE's {multiple} pixels (valid: {multiple} or more)"
             for name, size in (("width", width), ("height", height)) if size < multiple]
    if small:
        raise ValueError("; ".join(small))
    rows, cols = (slice((size % multiple) // 2, (size % multiple) // 2 + size // multiple * multiple)
                  for size in (height, width))
    return frames[:, rows, cols]
