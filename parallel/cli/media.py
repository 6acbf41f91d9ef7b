"""Reading videos, images and folders of frames for the command line; runs in the CLI (driver) process.

Everything comes back in ComfyUI's conventions: IMAGE = float32 [F, H, W, C] RGB(A) in 0..1, MASK = float32
[F, H, W] in 0..1. A path may be a video file (MP4 and the other containers FFmpeg reads, through PyAV), one image,
or a folder of images (the frames, in sorted file-name order). Masks are the luminance of the frames (BT.601,
OpenCV's RGB2GRAY), so white = 1. Errors are one line naming the flag and the path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..video_io import read_video

VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
FORMS = "an MP4 (or other video), an image, or a folder of images"


def _cv2():
    import cv2  # imported here: only the command line reads media

    return cv2


def _existing(path: str | Path, flag: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{flag} {path} does not exist; give {FORMS}")
    return path


def _to_unit_float(pixels: np.ndarray, flag: str, path: Path) -> np.ndarray:
    """uint8 / uint16 / float pixels -> float32 in 0..1."""
    if pixels.dtype == np.uint8:
        return pixels.astype(np.float32) / 255.0
    if pixels.dtype == np.uint16:
        return pixels.astype(np.float32) / 65535.0
    if pixels.dtype in (np.float32, np.float64):
        return np.clip(pixels, 0.0, 1.0).astype(np.float32)
    raise ValueError(f"{flag} {path} has pixels of type {pixels.dtype}; valid: 8- or 16-bit or float images")


def _image_rgb(path: Path, flag: str, keep_alpha: bool) -> np.ndarray:
    """One image file -> [H, W, 3 or 4] float32 RGB(A) in 0..1."""
    cv2 = _cv2()
    pixels = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if pixels is None:
        raise ValueError(f"{flag} {path} is not a readable image; give {FORMS}")
    if pixels.ndim == 2:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_GRAY2BGR)
    if pixels.shape[2] == 4 and keep_alpha:
        pixels = cv2.cvtColor(pixels, cv2.COLOR_BGRA2RGBA)
    else:
        pixels = cv2.cvtColor(pixels[:, :, :3], cv2.COLOR_BGR2RGB)
    return _to_unit_float(pixels, flag, path)


def _video_rgb(path: Path, flag: str) -> np.ndarray:
    """Every frame of a video file -> [F, H, W, 3] float32 RGB in 0..1 (PyAV, the pack's one video reader)."""
    import av

    try:
        return read_video(path).numpy()
    except (ValueError, av.FFmpegError) as error:
        raise ValueError(f"{flag} {path} is not a readable video ({error}); give {FORMS}") from None


def _folder_rgb(folder: Path, flag: str) -> np.ndarray:
    """The images of a folder in sorted name order -> [F, H, W, 3]; they must all have one size."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"{flag} {folder} is a folder without images ({', '.join(IMAGE_SUFFIXES)}); give {FORMS}")
    frames = [_image_rgb(path, flag, keep_alpha=False) for path in files]
    sizes = {frame.shape[:2] for frame in frames}
    if len(sizes) > 1:
        found = ", ".join(f"{w}x{h}" for h, w in sorted(sizes))
        raise ValueError(f"{flag} {folder}: the frames must all have one size, found {found} (width x height)")
    return np.stack(frames)


def read_frames(path: str | Path, flag: str = "frames") -> torch.Tensor:
    """A video file, an image or a folder of images -> IMAGE [F, H, W, 3] float32 RGB in 0..1."""
    path = _existing(path, flag)
    if path.is_dir():
        frames = _folder_rgb(path, flag)
    elif path.suffix.lower() in VIDEO_SUFFIXES:
        frames = _video_rgb(path, flag)
    else:
        frames = _image_rgb(path, flag, keep_alpha=False)[None]
    return torch.from_numpy(np.ascontiguousarray(frames))


def read_image(path: str | Path, flag: str = "image") -> torch.Tensor:
    """One image -> IMAGE [1, H, W, 3 or 4] float32 in 0..1; an alpha channel is kept (RGBA)."""
    path = _existing(path, flag)
    if path.is_dir() or path.suffix.lower() in VIDEO_SUFFIXES:
        raise ValueError(f"{flag} {path} is not an image file; give one image ({', '.join(IMAGE_SUFFIXES)})")
    return torch.from_numpy(np.ascontiguousarray(_image_rgb(path, flag, keep_alpha=True)))[None]


def luminance_mask(frames: torch.Tensor) -> torch.Tensor:
    """IMAGE [F, H, W, 3] in 0..1 -> MASK [F, H, W]: BT.601 luminance (OpenCV RGB2GRAY), white = 1."""
    cv2 = _cv2()
    count, height, width, _ = frames.shape
    rgb = np.ascontiguousarray(frames.numpy().reshape(count * height, width, 3))
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY).reshape(count, height, width)
    return torch.from_numpy(np.clip(grey, 0.0, 1.0))


def read_mask(path: str | Path, flag: str = "mask") -> torch.Tensor:
    """A video, image or folder -> MASK [F, H, W] in 0..1 (luminance; white = 1)."""
    return luminance_mask(read_frames(path, flag))
