"""Pixel formats between the VAE and the user; runs in the workers.

Pixels inside the workers are VAE-space tensors [B, 3, F, H, W] in -1..1; frames (what users save and what
ComfyUI's IMAGE holds) are [F, H, W, 3] float32 in 0..1.
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
