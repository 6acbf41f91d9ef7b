"""Writing the MP4 the command line produces; runs in the CLI (driver) process.

The file is H.264 (yuv420p) written atomically by `parallel/video_io.py`, the same writer the ComfyUI
save-video node uses.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..video_io import write_video


def write_mp4(frames: torch.Tensor, path: str | Path, fps: int = 16) -> Path:
    """Write [F, H, W, 3] 0..1 frames as an H.264 MP4; nothing appears under `path` unless the whole file did."""
    return write_video(frames, path, fps)
