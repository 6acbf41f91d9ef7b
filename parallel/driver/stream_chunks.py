"""Streaming chunks as the driver receives them; runs in the driver (ComfyUI or CLI) process.

Rank 0 sends each finished chunk of a ``StreamSample`` inside a progress message (its arrays copied out of
shared memory by the local backend's ``take_chunk``, or unpickled from Ray's queue); the pool hands
it to the progress callback as ``chunk=``. ``chunk_progress`` turns that into ``on_chunk(StreamChunk)`` calls
beside the ordinary ``progress(step, total)`` ones. ``ChunkFolder`` writes the chunk files (the command line's
``--chunk-dir``, the stream node's output folder) and never loses one silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
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


def chunk_progress(on_chunk: Callable[[StreamChunk], None] | None, progress: Callable | None,
                   on_event: Callable[[dict], None] | None = None) -> Callable:
    """The pool's progress callback for a stream: chunks go to ``on_chunk``, events (``{protocol.LIVE_PROMPT_EVENT:
    {...}}``) to ``on_event``, steps to ``progress``."""

    def report(step: int, total: int, preview=None, chunk: dict | None = None, event: dict | None = None) -> None:
        if chunk is not None:
            if on_chunk is not None:
                on_chunk(chunk_from_message(chunk))
        elif event is not None:
            if on_event is not None:
                on_event(event)
        elif progress is not None:
            progress(step, total)

    return report


class ChunksLost(RuntimeError):
    """Chunk files that the chunk folder does not hold at the end of a stream."""


class ChunkFolder:
    """Chunk files in a folder that must stay where it is: it is never recreated behind the user's back.

    Every chunk's frames are kept until ``finish``. A chunk whose file cannot be written (the folder disappeared,
    or is not writable) is reported at once through ``warn``, and written, with the chunk files lost with the
    folder, at the next chunk that finds the folder usable again. ``finish`` (after the whole video is written)
    tries once more and raises ``ChunksLost`` naming what the folder still lacks."""

    def __init__(self, folder: str | Path, write: Callable[[torch.Tensor, Path], object], warn: Callable[[str], None]):
        self.folder = Path(folder)
        self._write = write
        self._warn = warn
        self._frames: dict[Path, torch.Tensor] = {}
        self._problem: str | None = None  # why the last write failed, until the folder is usable again

    def add(self, name: str, frames: torch.Tensor) -> Path:
        """Keep the chunk, then write every kept chunk file the folder lacks; the new chunk's path."""
        path = self.folder / name
        self._frames[path] = frames
        self._write_missing(path)
        return path

    def missing(self) -> list[Path]:
        return [path for path in self._frames if not path.is_file()]

    def finish(self, whole_video: str | Path) -> None:
        self._write_missing(None)
        lost, self._frames = self.missing(), {}
        if lost:
            raise ChunksLost(f"{len(lost)} chunk files are not in {self.folder} ({self._problem}): "
                             f"{', '.join(path.name for path in lost)}; the whole video is in {whole_video}")

    def _write_missing(self, newest: Path | None) -> None:
        written = []
        for path in self.missing():
            problem = self._write_one(path)
            if problem is not None:
                self._problem = problem
                if newest is not None:
                    self._warn(f"{newest.name} not written: {problem}; {len(self.missing())} chunk files are kept "
                               "in memory and written when the folder is usable again")
                return
            written.append(path.name)
        if self._problem is not None and written:
            self._problem = None
            self._warn(f"{self.folder} is usable again: wrote {', '.join(written)}")

    def _write_one(self, path: Path) -> str | None:
        """Write one kept chunk file; why not, when it cannot be."""
        if not self.folder.exists():
            return f"the chunk folder {self.folder} disappeared"
        if not self.folder.is_dir():
            return f"{self.folder} is no longer a folder"
        try:
            self._write(self._frames[path], path)
        except OSError as error:
            return f"writing into {self.folder} failed ({error.strerror or error})"
        return None
