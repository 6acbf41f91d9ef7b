"""The local worker process: one per device, started by the pool in a fresh interpreter (``--rank N``).

It waits for the driver's word that the pool's temp folder exists, joins the pool's process group
(``session.WorkerSession``, shared with the Ray actor), imports the model code it will run, says hello, then
serves requests from its connection until told to shut down. A receiver thread reads the connection so that a cancel arrives while a request runs,
and the worker exits as soon as the driver goes away (connection EOF, parent-death signal, or a changed parent
pid), removing the pool's temp folder and shared memory, so no worker or file outlives its driver. SIGTERM or
SIGINT sent to a rank whose driver lives ends that rank by the signal without a traceback.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from .. import protocol as P
from ..config import ParallelConfig
from ..transport import ShmReader, ShmWriter, pack_handed_over, remove_segments
from .session import WorkerSession

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.5
ORPHAN_SETTLE_S = 2.0
# Blocked in every thread (by the bootstrap, before any thread exists) and taken by one thread in ``sigwait``.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})

# -- the local-backend process -------------------------------------------------------------------------


def guard_against_orphaning(parent_pid: int, on_orphaned: Callable[[], None] | None = None,
                            driver_pid: int | None = None) -> None:
    """Die with the driver: a parent-death signal (Linux) plus a thread that watches the parent pid.

    The parent-death signal is SIGTERM. SIGTERM and SIGINT are blocked in every thread (the local backend's
    ``BOOTSTRAP`` blocks them before any thread exists: a thread that did not block them would take the signal's
    default action and kill the process without cleanup) and taken by one thread in ``sigwait`` (Python
    handlers run only when the main thread runs Python code, and it may sit inside a collective). An orphaned
    worker runs ``on_orphaned`` (removing what the dead driver left behind) and exits; a signal sent to a rank
    whose driver lives ends the rank by that signal, quietly: the driver names the rank and the signal."""
    cleanup = on_orphaned or (lambda: None)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # threads started from here on inherit the mask
    for sig in STOP_SIGNALS:  # the action _end_by re-raises (only the main thread may set it)
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:  # the driver died before the signal was armed
        _leave(cleanup)

    def watch() -> None:
        while not driver_gone(parent_pid, settle=False, driver_pid=driver_pid):
            time.sleep(PARENT_POLL_S)
        _leave(cleanup)

    def take_stop_signals() -> None:
        received = signal.sigwait(STOP_SIGNALS)
        # SIGTERM may be the parent-death signal, which comes before the driver is gone: give that a moment.
        if driver_gone(parent_pid, settle=received == signal.SIGTERM, driver_pid=driver_pid):
            _leave(cleanup)
        _end_by(received)  # a live driver cleans up itself

    threading.Thread(target=watch, name="wanmesh-parent-watch", daemon=True).start()
    threading.Thread(target=take_stop_signals, name="wanmesh-stop-signals", daemon=True).start()


def driver_gone(parent_pid: int, settle: bool = True, driver_pid: int | None = None) -> bool:
    """Whether the driver has died: this worker was re-parented, or (a worker forked by the worker template, whose
    parent is the template) the driver process ``driver_pid`` has ended, which shows before the template's own
    death does. With ``settle``, wait up to ``ORPHAN_SETTLE_S`` for that to show: a dying driver's parent-death
    signal and closed connections come when its launcher thread ends, before its process is gone."""
    deadline = time.monotonic() + (ORPHAN_SETTLE_S if settle else 0.0)
    gone = lambda: os.getppid() != parent_pid or (driver_pid is not None and process_ended(driver_pid))  # noqa: E731
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    return gone()


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False


# Held while this process creates a shared-memory segment, and taken for good by _leave before its cleanup: a
# segment made by one thread (a streaming chunk, a reply) just after another thread's cleanup listed the segments
# would outlive the process; with the lock, creation either ends before the cleanup (which removes it) or waits
# for the exit.
SEGMENT_CREATION = threading.RLock()
LEAVE_WAIT_S = 10.0  # creating a segment takes milliseconds; never wait for ever to leave


def _leave(cleanup: Callable[[], None], code: int = 1) -> None:
    try:
        SEGMENT_CREATION.acquire(timeout=LEAVE_WAIT_S)
        cleanup()
    finally:
        os._exit(code)


def _end_by(sig: int) -> None:
    """End the process by ``sig``'s default action (no traceback; its exit status names the signal)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})  # this thread only
    signal.pthread_kill(threading.get_ident(), sig)
    time.sleep(1.0)
    os._exit(128 + sig)


def wait_for_pool_folder(conn: Connection, cleanup: Callable[[], None]) -> None:
    """The driver makes the pool's temp folder only once its workers exist (so that one of them is always there to
    remove it if the driver dies), then says so: wait for that word; a closed connection means the driver died."""
    try:
        message = conn.recv()
    except (EOFError, OSError):
        _leave(cleanup)
    if message.get("kind") != "pool_folder_ready":
        raise RuntimeError(f"expected the driver's pool_folder_ready first, got {message.get('kind')!r}")


def remove_pool_leftovers(shm_prefix: str, pool_dir: str | None) -> None:
    """What a dead driver can no longer remove: the pool's shared-memory segments and its temp folder."""
    remove_segments(shm_prefix)
    if pool_dir:
        shutil.rmtree(pool_dir, ignore_errors=True)


class LocalWorker:
    """Serves one rank of a local pool over its connection to the driver."""

    def __init__(self, session: WorkerSession, conn: Connection, shm_prefix: str,
                 on_driver_gone: Callable[[], None] | None = None):
        self.session = session
        self.conn = conn
        self.on_driver_gone = on_driver_gone or (lambda: None)
        self.reader = ShmReader(copy_on_write=True)
        self.writer = ShmWriter(f"{shm_prefix}_r{session.rank}", tracked=False) if session.rank == 0 else None
        self.shm_prefix = shm_prefix
        self._chunks_sent = 0
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
                self.session.cancel(message["id"])
            elif message.get("kind") == "live":
                self.session.live_input(message["id"], message["fields"])
            else:
                self.inbox.put(message)

    def exit_now(self, code: int = 0) -> None:
        """The connection is gone: leave at once, even from inside a collective that would never finish
        (``on_driver_gone`` decides whether a dead driver left anything to remove)."""
        if self.writer is not None:
            self.writer.close()
        _leave(self.on_driver_gone, code)

    def send_heartbeat(self, fields: dict[str, Any]) -> None:
        try:
            self.send({"kind": "heartbeat", "rank": self.session.rank, **fields})
        except (OSError, ValueError):  # the driver is gone
            self.exit_now()

    def serve(self) -> None:
        threading.Thread(target=self.receive_forever, name="wanmesh-receiver", daemon=True).start()
        self.session.start_heartbeats(self.send_heartbeat)
        while True:
            message = self.inbox.get()
            self.send(self._run(message, message["id"]))
            if message["body"].get("kind") == P.Shutdown.kind:
                return

    def _run(self, message: dict[str, Any], request_id: int) -> dict[str, Any]:
        # Request tensors are copy-on-write views of the driver's arena, valid while this request runs:
        # handlers must copy what they keep. Fresh mappings per request keep earlier private writes out.
        self.reader.forget_except(set())
        return self.session.run(message["body"], request_id, self.reader.view, self._pack_reply,
                                lambda fields: self._send_progress(request_id, fields))

    def _pack_reply(self, reply: P.Reply) -> dict[str, Any]:
        with SEGMENT_CREATION:
            self.writer.reserve(P.tensors_in(reply))
            return P.encode_message(reply, self.writer.pack)

    def _send_progress(self, request_id: int, fields: dict[str, Any]) -> None:
        chunk = fields.get("chunk")
        if chunk is not None:
            # A streaming chunk's arrays (tens of MB of frames) go through a shared-memory segment the driver
            # takes over, not through the pipe: pickling them there would hold this rank, and so every rank at
            # its next collective, for as long as the driver takes to read them.
            self._chunks_sent += 1
            with SEGMENT_CREATION:
                fields = {**fields, "chunk": pack_handed_over(chunk, f"{self.shm_prefix}_r0c{self._chunks_sent}")}
        self.send({"kind": "progress", "id": request_id, **fields})


def main(argv: list[str] | None = None) -> None:
    """Entry point of a local worker process: ``argv[0]`` is the JSON settings written by the pool (``--rank N``
    follows it so that ``ps`` shows which rank a process is)."""
    settings = json.loads((argv if argv is not None else sys.argv[1:])[0])
    leftovers = lambda: remove_pool_leftovers(settings["shm_prefix"], settings.get("pool_dir"))  # noqa: E731
    guard_against_orphaning(settings["parent_pid"], leftovers, settings.get("driver_pid"))
    conn = Connection(settings["fd"])
    rank = settings["rank"]
    try:
        wait_for_pool_folder(conn, leftovers)
        config = ParallelConfig.from_dict(settings["config"])
        store = torch.distributed.FileStore(settings["store"], config.world)
        session = WorkerSession(config, rank, torch.device(settings["device"]), store,
                                pg_timeout_s=settings["pg_timeout_s"],
                                collective_timeout_s=settings.get("collective_timeout_s"),
                                diagnostics=settings.get("diagnostics"))
    except Exception as exc:
        conn.send({"kind": "error", **P.WorkerError(rank, type(exc).__name__, str(exc), traceback.format_exc()).to_wire()})
        os._exit(1)
    # A closed connection is not always a dead driver (a live driver closes its end when it stops the pool, and
    # removes its segments itself): remove the pool's leftovers only when the driver really is gone.
    worker = LocalWorker(session, conn, settings["shm_prefix"],
                         lambda: leftovers() if driver_gone(settings["parent_pid"], driver_pid=settings.get("driver_pid"))
                         else None)
    # Before the hello: the pool's start (under its start timeout) waits for the imports, not its first request
    # (which is watched by heartbeats that a worker busy importing would not send).
    session.preload_model_code()
    worker.send({"kind": "hello", **session.health()})
    worker.serve()
    _leave_after_shutdown(worker)


def _leave_after_shutdown(worker: LocalWorker) -> None:
    """Tear down in order, then end the process at once. The receiver thread is still blocked reading the
    connection: closing it under that thread, or letting the interpreter and torch's C++ destructors tear down
    around it, printed three times in about 180 pool stops a receiver traceback (a read from the closed
    connection) or "terminate called without an active exception". The driver sees the connection close when
    the process ends."""
    if worker.writer is not None:
        worker.writer.close()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
