"""Writing and reading video files (H.264 MP4 through PyAV); runs in the driver process (ComfyUI or the CLI).

`write_video` never leaves a partial file under the name asked for: it encodes into a hidden temporary file in
the same folder (same suffix, so FFmpeg picks the same container), flushes and fsyncs it, reopens it to check
the frame count and size, and only then renames it into place. Any failure removes the temporary file and the
error propagates unchanged (an OSError such as ENOSPC or EFBIG stays an OSError). PyAV (`av`) is imported
inside the functions (and torch with the first frames) so that importing this module stays light.

Frames follow ComfyUI's IMAGE convention: float [F, H, W, 3] in 0..1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import numbers
import os
import secrets
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

if TYPE_CHECKING:  # torch loads with the first video read or written: the command line's checks run without it
    import torch

log = logging.getLogger(__name__)

# Encoders tried in order: H.264 (libx264, then Cisco's openh264), then MPEG-4 part 2 as a last resort.
H264_ENCODERS = ("libx264", "libopenh264")
FALLBACK_ENCODER = "mpeg4"
CONTAINERS = {".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".mkv": "matroska"}
MAX_FPS = 1000.0


def check_fps(fps: float) -> Fraction:
    """The frame rate as an exact fraction (23.976 -> 2997/125); a one-line ValueError when it is unusable."""
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps) or not 0 < fps <= MAX_FPS:
        shown = f"{fps:g}" if isinstance(fps, numbers.Real) and not isinstance(fps, bool) else repr(fps)
        raise ValueError(f"fps {shown} is not a usable frame rate; valid: a number above 0 and at most {MAX_FPS:g}")
    return Fraction(float(fps)).limit_denominator(1001)


def check_even_frame_size(width: int, height: int) -> None:
    """yuv420p halves the colour planes, so both sides must be even (Wan sizes are multiples of 8)."""
    if width < 2 or height < 2 or width % 2 or height % 2:
        raise ValueError(f"frame size {width}x{height} (width x height) cannot be written as H.264 yuv420p; "
                         f"valid: even sizes of at least 2, e.g. {_even(width)}x{_even(height)}")


def check_container(path: str | Path) -> str:
    """FFmpeg's container (muxer) name for the file's suffix."""
    suffix = Path(path).suffix.lower()
    if suffix not in CONTAINERS:
        raise ValueError(f"video file {path} has the suffix {suffix or '(none)'!r}; valid: {', '.join(CONTAINERS)}")
    return CONTAINERS[suffix]


def write_video(frames: torch.Tensor, path: str | Path, fps: float, *, crf: int = 19) -> Path:
    """Write IMAGE frames [F, H, W, 3] (0..1) as H.264 yuv420p at `fps`, atomically; returns the final path."""
    path = Path(path)
    pixels = _to_rgb24(frames)
    rate = check_fps(fps)
    check_container(path)
    if isinstance(crf, bool) or not isinstance(crf, int) or not 0 <= crf <= 51:
        raise ValueError(f"crf {crf!r} is not an H.264 quality; valid: an integer from 0 (lossless) to 51 (worst)")
    with written_atomically(path) as temporary:
        _encode(pixels, temporary, rate, crf)
        _check_written(temporary, pixels.shape[:3])
    return path


def read_video(path: str | Path) -> torch.Tensor:
    """Every frame of the first video stream -> float32 [F, H, W, 3] in 0..1."""
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError(f"{path} holds no video stream; give a video file such as an MP4")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
    if not frames:
        raise ValueError(f"{path}: no frame could be decoded from its video stream")
    import torch

    return torch.from_numpy(np.stack(frames)).float().div_(255.0)


@functools.lru_cache(maxsize=1)
def video_encoder() -> str:
    """The encoder write_video uses: libx264 when PyAV's FFmpeg has it, else openh264, else mpeg4 (warned)."""
    import av

    for name in (*H264_ENCODERS, FALLBACK_ENCODER):
        try:
            av.Codec(name, "w")
        except Exception:  # noqa: BLE001 - PyAV raises different errors for a missing codec across versions
            continue
        if name != H264_ENCODERS[0]:
            log.warning("PyAV's FFmpeg has no libx264 encoder; writing videos with %s%s", name,
                        "" if name in H264_ENCODERS else " (MPEG-4 part 2: browsers may not play these files)")
        return name
    raise RuntimeError(f"PyAV's FFmpeg has none of the video encoders {', '.join((*H264_ENCODERS, FALLBACK_ENCODER))}")


def _even(size: int) -> int:
    return max(2, size + (size % 2))


def _to_rgb24(frames: torch.Tensor) -> np.ndarray:
    """[F, H, W, 3] float 0..1 (any device or dtype) -> uint8 [F, H, W, 3], checked before any encoding."""
    import torch

    if not isinstance(frames, torch.Tensor) or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
        shape = list(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"frames must be a tensor [frames, height, width, 3] with at least one frame, got {shape}")
    check_even_frame_size(frames.shape[2], frames.shape[1])
    pixels = (frames.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return np.ascontiguousarray(pixels.cpu().numpy())


@contextlib.contextmanager
def written_atomically(path: Path) -> Iterator[Path]:
    """Yields a new temporary file beside ``path`` for the caller to write and check; then fsyncs it, renames it
    onto ``path`` and fsyncs the folder. On any failure the temporary file is removed and nothing appears under
    ``path``. Missing parent folders are created."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _create_temporary(path)
    mode = temporary.stat().st_mode & 0o777  # 0666 less the umask; a writer that replaces the file may narrow it
    try:
        yield temporary
        os.chmod(temporary, mode)  # (safetensors writes its files 0600): every output gets the user's umask
        fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def _create_temporary(path: Path) -> Path:
    """A new, hidden file beside `path` with its suffix (O_EXCL; permissions from the umask, like any new file)."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}{path.suffix}")
    os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return temporary


def _encode(pixels: np.ndarray, path: Path, rate: Fraction, crf: int) -> None:
    import av

    encoder = video_encoder()
    options = {"movflags": "+faststart"} if CONTAINERS[path.suffix.lower()] in ("mp4", "mov") else {}
    count, height, width, _ = pixels.shape
    with av.open(str(path), mode="w", format=CONTAINERS[path.suffix.lower()], options=options) as container:
        stream = container.add_stream(encoder, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if encoder == "libx264":
            stream.options = {"crf": str(crf)}
        else:  # no crf: a generous bit rate (about 0.3 bit per pixel) instead
            stream.bit_rate = int(0.3 * width * height * float(rate))
        for index in range(count):
            frame = av.VideoFrame.from_ndarray(pixels[index], format="rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))


def fsync_file(path: Path) -> None:
    descriptor = os.open(path, os.O_RDWR)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_folder(folder: Path) -> None:
    """Makes the rename itself durable where the OS allows opening a folder (POSIX)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _check_written(path: Path, expected: tuple[int, int, int]) -> None:
    """Reopen the encoded file: it must be non-empty and decode to the expected frame count and size."""
    import av

    if path.stat().st_size == 0:
        raise RuntimeError(f"the encoder wrote an empty file {path}")
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        count = sum(1 for _ in container.decode(stream))
        found = (count, stream.codec_context.height, stream.codec_context.width)
    if found != tuple(expected):
        raise RuntimeError(f"reading {path} back gave {found[0]} frames of {found[2]}x{found[1]}; "
                           f"expected {expected[0]} frames of {expected[2]}x{expected[1]}")
