"""Writing the MP4 the command line produces; runs in the CLI process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


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
