"""Streaming chunks as the driver receives them; runs in the driver (ComfyUI or CLI) process.

Rank 0 sends each finished chunk of a ``StreamSample`` inside a progress message (its arrays copied out of
shared memory by the local backend's ``take_chunk``, or unpickled from Ray's queue); the pool hands
it to the progress callback as ``chunk=``. ``chunk_progress`` turns that into ``on_chunk(StreamChunk)`` calls
beside the ordinary ``progress(step, total)`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class StreamChunk:
    """One finished chunk: raw latents [B, 16, n, h, w], frames [F, H, W, 3] in 0..1 (None without a VAE)."""

    index: int
    start_frame: int  # latent frame where the chunk starts
    latents: torch.Tensor
    frames: torch.Tensor | None

    @property
    def first_image_frame(self) -> int:
        """Index of the chunk's first decoded frame in the whole video (latent frame 0 decodes to 1 frame)."""
        return 0 if self.start_frame == 0 else 4 * self.start_frame - 3


def chunk_from_message(chunk: dict) -> StreamChunk:
    frames = chunk.get("frames")
    return StreamChunk(int(chunk["index"]), int(chunk["start_frame"]), torch.as_tensor(chunk["latents"]),
                       None if frames is None else torch.as_tensor(frames))


def chunk_progress(on_chunk: Callable[[StreamChunk], None] | None, progress: Callable | None) -> Callable:
    """The pool's progress callback for a stream: chunks go to ``on_chunk``, steps to ``progress``."""

    def report(step: int, total: int, preview=None, chunk: dict | None = None) -> None:
        if chunk is not None:
            if on_chunk is not None:
                on_chunk(chunk_from_message(chunk))
        elif progress is not None:
            progress(step, total)

    return report
