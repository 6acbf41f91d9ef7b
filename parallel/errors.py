"""The exceptions the driver, its backends and the workers share; imported by both processes (plain Python).

One module, so that the pool, the local and Ray backends and the worker runtime raise and catch the same
classes without importing each other.
"""

from __future__ import annotations

from typing import Any


class ProtocolError(ValueError):
    """A message that is not part of this protocol version."""


class Cancelled(RuntimeError):
    """The caller cancelled: the workers stopped at a step boundary and the pool is still usable, or (a load,
    or a rank that stopped answering) the pool was stopped and starts afresh on next use."""


class RankDied(Exception):
    """Raised by a backend when a worker process or actor is gone."""

    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank}: {detail}")
        self.rank = rank
        self.detail = detail


class WorkerError(RuntimeError):
    """A failure inside a worker (or of a worker process), as the caller sees it."""

    def __init__(self, rank: int | None, error_type: str, message: str, traceback: str = ""):
        self.rank = rank
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "worker pool"
        text = f"{self.error_type}: {self.message}"
        if not self.message.startswith(f"{where} "):  # the message may already name the rank
            text = f"{where}: {text}"
        if self.traceback:
            text += f"\n--- traceback on {where} ---\n{self.traceback.rstrip()}"
        return text

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "error", "rank": self.rank, "error_type": self.error_type,
                "message": self.message, "traceback": self.traceback}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> "WorkerError":
        return cls(data.get("rank"), data["error_type"], data["message"], data.get("traceback", ""))
