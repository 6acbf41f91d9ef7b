"""Prompts posted to a stream while it runs; runs in the driver (ComfyUI) process.

A client posts a prompt text from another thread (the pack's ``POST /wanmesh/stream/<id>/prompt`` route); the
pool call of the running stream takes the new texts at its next poll and sends them to rank 0 as ``live``
messages. Rank 0 applies the oldest pending text at the next chunk boundary (every rank learns it by one
broadcast, and every rank encodes it with the stream's text encoder), and reports the chunk as a
``protocol.LIVE_PROMPT_EVENT`` event; ``applied`` then answers the poster's future with that chunk. What the
stream cannot apply any more (it ended, failed or was cancelled) is answered with the reason by ``close``.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future


class StreamEnded(RuntimeError):
    """A posted prompt the stream can no longer apply; the message says why."""


class LivePrompts:
    """The prompts posted to one running stream, in the order they were posted."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queued: deque[tuple[str, Future]] = deque()  # posted, not yet sent to rank 0
        self._sent: deque[tuple[str, Future]] = deque()  # sent, waiting for their chunk
        self._ended: str | None = None

    def post(self, text: str) -> Future:
        """Queue ``text``; the future gets the chunk where the prompt applies (or ``StreamEnded``)."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a posted prompt must be non-empty text, got {text!r}")
        future: Future = Future()
        with self._lock:
            if self._ended is not None:
                raise StreamEnded(self._ended)
            self._queued.append((text, future))
        return future

    def take_new(self) -> list[dict]:
        """The ``live`` messages' fields for the texts posted since the last call (the pool call's poll)."""
        with self._lock:
            taken = list(self._queued)
            self._sent.extend(taken)
            self._queued.clear()
        return [{"prompt": text} for text, _ in taken]

    def applied(self, event: dict) -> None:
        """Rank 0 applied the oldest sent prompt at ``event["chunk"]``."""
        with self._lock:
            if not self._sent:
                return
            _, future = self._sent.popleft()
        future.set_result(int(event["chunk"]))

    def close(self, why: str) -> None:
        """The stream ended: every prompt not applied is answered with ``why``; later posts are refused."""
        with self._lock:
            self._ended = why
            left = list(self._sent) + list(self._queued)
            self._sent.clear()
            self._queued.clear()
        for _, future in left:
            future.set_exception(StreamEnded(why))
