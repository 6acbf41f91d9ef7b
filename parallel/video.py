"""Video geometry and pixel formats: size checks, latent shapes, frame tensors, and MP4 writing.

Pixels inside the engine are VAE-space tensors [B, 3, F, H, W] in -1..1; frames (what users save and what
ComfyUI's IMAGE holds) are [F, H, W, 3] float32 in 0..1.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SPATIAL_STRIDE = 16  # VAE 8x times the transformer's 2x2 patches
TEMPORAL_STRIDE = 4  # frames are 4k + 1
LATENT_CHANNELS = 16


def _nearest(value: int, step: int, offset: int, minimum: int) -> str:
    """The valid values of the form step*k + offset (at least `minimum`) just below and above `value`."""
    below = (value - offset) // step * step + offset
    candidates = [v for v in (below, below + step) if v >= minimum]
    return " or ".join(str(v) for v in dict.fromkeys(candidates))


def check_video_size(width: int, height: int, frames: int) -> None:
    """Reject sizes Wan cannot generate, naming the nearest valid values, before any work starts."""
    problems = []
    for name, value in (("width", width), ("height", height)):
        if value < SPATIAL_STRIDE or value % SPATIAL_STRIDE:
            near = _nearest(value, SPATIAL_STRIDE, 0, SPATIAL_STRIDE)
            problems.append(f"{name} {value} is not a positive multiple of {SPATIAL_STRIDE} (nearest valid: {near})")
    if frames < 1 or (frames - 1) % TEMPORAL_STRIDE:
        near = _nearest(frames, TEMPORAL_STRIDE, 1, 1)
        problems.append(f"frame count {frames} is not of the form 4k+1 (nearest valid: {near})")
    if problems:
        raise ValueError("; ".join(problems))


def latent_shape(width: int, height: int, frames: int, batch: int = 1) -> tuple[int, int, int, int, int]:
    check_video_size(width, height, frames)
    return (batch, LATENT_CHANNELS, (frames - 1) // TEMPORAL_STRIDE + 1, height // 8, width // 8)


def check_latent(latent: torch.Tensor) -> None:
    """A latent the transformer can take: [B, 16, T, h, w] with even h and w (2x2 patches)."""
    if latent.ndim != 5 or latent.shape[1] != LATENT_CHANNELS:
        raise ValueError(f"expected Wan latents [B, 16, T, H/8, W/8], got shape {list(latent.shape)}")
    h, w = latent.shape[-2:]
    if h % 2 or w % 2:
        raise ValueError(
            f"latent spatial size {h}x{w} must be even (video size a multiple of 16); got a {w * 8}x{h * 8} video"
        )


def pixels_to_frames(pixels: torch.Tensor) -> torch.Tensor:
    """[B, 3, F, H, W] in -1..1 -> [B*F, H, W, 3] float32 in 0..1."""
    frames = ((pixels.float().clamp(-1.0, 1.0) + 1.0) / 2.0).permute(0, 2, 3, 4, 1)
    return frames.reshape(-1, *frames.shape[2:]).contiguous().cpu()


def frames_to_pixels(frames: torch.Tensor) -> torch.Tensor:
    """[F, H, W, 3] in 0..1 -> [1, 3, F, H, W] in -1..1 (channels beyond 3 are dropped, as ComfyUI does)."""
    if frames.ndim != 4 or frames.shape[-1] < 3:
        raise ValueError(f"expected frames [F, H, W, 3], got shape {list(frames.shape)}")
    return (frames[..., :3].float() * 2.0 - 1.0).permute(3, 0, 1, 2).unsqueeze(0).contiguous()


def write_mp4(frames: torch.Tensor, path: str | Path, fps: int = 16) -> Path:
    """Write [F, H, W, 3] 0..1 frames as an MP4 (OpenCV's bundled FFmpeg, mp4v codec)."""
    import cv2  # imported here: only the command line writes videos

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV could not open {path} for writing an MP4 video")
    try:
        for frame in (frames.clamp(0, 1) * 255).round().to(torch.uint8).numpy():
            writer.write(np.ascontiguousarray(frame[:, :, ::-1]))  # OpenCV wants BGR
    finally:
        writer.release()
    return path
