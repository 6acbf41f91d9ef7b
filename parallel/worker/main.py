"""The local worker process: one per device, started by the pool in a fresh interpreter (``--rank N``).

It joins the pool's process group, says hello, then serves requests on its ``WorkerRuntime`` until told to
shut down. A receiver thread reads the connection so that a cancel arrives while a request runs, and the
worker exits as soon as the driver goes away (connection EOF, parent-death signal, or a changed parent
pid), so no worker outlives its driver.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from .. import protocol as P
from ..config import ParallelConfig
from ..distributed.mesh import init_distributed
from ..transport import ShmReader, ShmWriter
from .runtime import THREADS_ENV, StepReporter, WorkerRuntime

PR_SET_PDEATHSIG = 1

# -- the local-backend process -------------------------------------------------------------------------


def guard_against_orphaning(parent_pid: int) -> None:
    """Die with the driver: a parent-death signal (Linux) plus a thread that watches the parent pid."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the driver died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="wanmesh-parent-watch", daemon=True).start()


class LocalWorker:
    """Serves one rank of a local pool over its connection to the driver."""

    def __init__(self, runtime: WorkerRuntime, conn: Connection, shm_prefix: str):
        self.runtime = runtime
        self.conn = conn
        self.reader = ShmReader(copy_on_write=True)
        self.writer = ShmWriter(f"{shm_prefix}_r{runtime.rank}", tracked=False) if runtime.rank == 0 else None
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.conn.send(message)

    def receive_forever(self) -> None:
        """Receiver thread: cancels take effect at once; requests queue for the main thread."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                self.exit_now()
            if message.get("kind") == "cancel":
                self.runtime.stops.cancel(message["id"])
            else:
                self.inbox.put(message)

    def exit_now(self, code: int = 0) -> None:
        """The driver is gone: leave at once, even from inside a collective that would never finish."""
        if self.writer is not None:
            self.writer.close()
        os._exit(code)

    def serve(self) -> None:
        threading.Thread(target=self.receive_forever, name="wanmesh-receiver", daemon=True).start()
        while True:
            message = self.inbox.get()
            request_id = message["id"]
            outcome = self._run(message, request_id)
            outcome["id"] = request_id
            self.send(outcome)
            if message["body"].get("kind") == P.Shutdown.kind:
                return

    def _run(self, message: dict[str, Any], request_id: int) -> dict[str, Any]:
        # Request tensors are copy-on-write views of the driver's arena, valid while this request runs:
        # handlers must copy what they keep. Fresh mappings per request keep earlier private writes out.
        self.reader.forget_except(set())
        progress = self._progress_sender(request_id)
        return self.runtime.execute_wire(message["body"], request_id, self.reader.view, self._pack_reply, progress)

    def _pack_reply(self, reply: P.Reply) -> dict[str, Any]:
        self.writer.reserve(P.tensors_in(reply))
        return P.encode_message(reply, self.writer.pack)

    def _progress_sender(self, request_id: int) -> StepReporter:
        if self.runtime.rank != 0:
            return StepReporter(None)
        return StepReporter(lambda fields: self.send({"kind": "progress", "id": request_id, **fields}))


def _configure_threads(device: torch.device, world: int) -> None:
    if device.type == "cpu":
        threads = int(os.environ.get(THREADS_ENV) or max(1, (os.cpu_count() or 1) // world))
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a local worker process: ``argv[0]`` is the JSON settings written by the pool (``--rank N``
    follows it so that ``ps`` shows which rank a process is)."""
    settings = json.loads((argv if argv is not None else sys.argv[1:])[0])
    guard_against_orphaning(settings["parent_pid"])
    conn = Connection(settings["fd"])
    rank = settings["rank"]
    try:
        config = ParallelConfig.from_dict(settings["config"])
        device = torch.device(settings["device"])
        _configure_threads(device, config.world)
        store = torch.distributed.FileStore(settings["store"], config.world)
        parallel = init_distributed(config, rank, device, store, settings["pg_timeout_s"])
        runtime = WorkerRuntime(parallel, settings.get("diagnostics"))
    except Exception as exc:
        conn.send({"kind": "error", **P.WorkerError(rank, type(exc).__name__, str(exc), traceback.format_exc()).to_wire()})
        os._exit(1)
    worker = LocalWorker(runtime, conn, settings["shm_prefix"])
    worker.send({"kind": "hello", **runtime.health()})
    worker.serve()
    if worker.writer is not None:
        worker.writer.close()
    torch.distributed.destroy_process_group()
    conn.close()
