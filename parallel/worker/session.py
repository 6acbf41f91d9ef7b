"""One rank's worker session, whatever hosts it; runs in a worker process (a local worker or a Ray actor).

The session is everything a rank does that does not depend on how requests reach it: CPU threads, joining the
process groups, the runtime that dispatches requests (``runtime.WorkerRuntime``), the heartbeat thread, cancels,
and running one wire request into its wire outcome. The two hosts are thin: ``main.LocalWorker`` reads requests
from its connection and writes outcomes and progress back through it (tensors in shared memory), the Ray actor
(``driver/ray_backend.py``) gets each request as an actor call and reports progress through a Ray queue.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import torch

from .. import protocol as P
from ..config import ParallelConfig, heartbeat_interval
from ..distributed.mesh import init_distributed
from .memory import return_freed_heap
from .runtime import THREADS_ENV, StepReporter, WorkerRuntime, beat_forever

Send = Callable[[dict[str, Any]], None]


def configure_threads(device: torch.device, world: int) -> None:
    """CPU ranks share the machine's cores (``WANMESH_WORKER_THREADS`` overrides the even split)."""
    if device.type == "cpu":
        threads = int(os.environ.get(THREADS_ENV) or max(1, (os.cpu_count() or 1) // world))
        torch.set_num_threads(threads)


class WorkerSession:
    """One rank: joined to its process groups, serving wire requests with its runtime."""

    def __init__(self, config: ParallelConfig, rank: int, device: torch.device, store, *, pg_timeout_s: float,
                 collective_timeout_s: float | None = None, diagnostics: str | None = None):
        configure_threads(device, config.world)
        parallel = init_distributed(config, rank, device, store, pg_timeout_s, collective_timeout_s=collective_timeout_s)
        self.config = config
        self.runtime = WorkerRuntime(parallel, diagnostics)

    @property
    def rank(self) -> int:
        return self.runtime.rank

    def health(self) -> dict[str, Any]:
        return self.runtime.health()

    def preload_model_code(self) -> None:
        self.runtime.preload_model_code()

    def start_heartbeats(self, send: Send) -> None:
        """A thread sending this rank's status while a request runs (silent ranks are how hangs are named)."""
        threading.Thread(target=beat_forever, args=(self.runtime.status, heartbeat_interval(self.config.worker_timeout),
                                                    send), name="wanmesh-heartbeat", daemon=True).start()

    def cancel(self, request_id: int) -> None:
        self.runtime.stops.cancel(request_id)

    def live_input(self, request_id: int, fields: dict[str, Any]) -> None:
        self.runtime.live.put(request_id, fields)

    def run(self, body: dict[str, Any], request_id: int, unpack: Callable[[Any], torch.Tensor],
            pack_reply: Callable[[P.Reply], dict[str, Any]], send_progress: Send) -> dict[str, Any]:
        """One wire request run to its wire outcome (tagged with ``request_id``); only rank 0 reports progress."""
        progress = StepReporter(send_progress if self.rank == 0 else None, self.runtime.status)
        outcome = self.runtime.execute_wire(body, request_id, unpack, pack_reply, progress)
        outcome["id"] = request_id
        # The request's intermediates are freed by now; glibc would keep their pages in its arenas, and a pool that
        # served many prompts would hold (for the system) the peak of its largest one.
        return_freed_heap()
        return outcome
