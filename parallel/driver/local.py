"""The local backend: one worker process per device on this machine.

Workers start in fresh interpreters (``python -c BOOTSTRAP``), never through ``multiprocessing`` spawn,
which would re-import the host's ``__main__`` (ComfyUI's ``main.py``). The bootstrap registers this pack's
folder as the package ``wanmesh`` without running its root ``__init__`` (the ComfyUI entry point), so the
worker runs the same code whatever name the host imported the pack under, or whether it was pip-installed.

Each worker talks to the driver over a private socket pair (nothing listens), and the ranks meet through
a file store in a private folder; gloo and NCCL are told to use the loopback interface. Tensors move through
shared memory (``transport.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from .. import protocol as P
from ..config import ParallelConfig
from ..errors import Cancelled, RankDied
from ..gpus import worker_device_env
from ..transport import (SHM_DIR, SegmentJanitor, ShmReader, ShmWriter, new_segment_prefix, segment_names,
                         segment_owner_pid, take_handed_over)
from .worker_template import TemplateGone, shared_template, template_wanted

PACK_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the pack root
# SIGTERM and SIGINT are blocked in every thread of a worker and taken by one (worker/main.py
# guard_against_orphaning): a thread that had not blocked them would die by them, cleaning nothing. So they are
# blocked before an import can start a thread (torch's do), and after multiprocessing's resource tracker has
# started: starting its process unblocks both in the calling thread (which would be the worker's main thread at
# its first shared-memory segment).
BOOTSTRAP = (
    "from multiprocessing import resource_tracker\n"
    "resource_tracker.ensure_running()\n"
    "import signal\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})\n"
    "import sys, types\n"
    "pack = types.ModuleType('wanmesh')\n"
    "pack.__path__ = [sys.argv[1]]\n"
    "sys.modules['wanmesh'] = pack\n"
    "from wanmesh.parallel.worker.main import main\n"
    "main(sys.argv[2:])\n"
)
# The worker template (worker/template.py) starts the same way and forks the workers from its imported code.
TEMPLATE_BOOTSTRAP = BOOTSTRAP.replace("worker.main import main", "worker.template import main")
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
SHUTDOWN_GRACE_S = 5.0
POOL_DIR_PREFIX = "wanmesh-pool-"
OWNER_FILE = "owner.pid"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def _owner_pid(pool_dir: str) -> int | None:
    try:
        with open(os.path.join(pool_dir, OWNER_FILE)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def sweep_stale_pool_files() -> list[str]:
    """Remove pool temp folders and shared-memory segments whose driver process is gone (a driver killed
    before it or its workers could clean up). Returns what was removed."""
    removed = []
    temp = tempfile.gettempdir()
    for name in os.listdir(temp):
        path = os.path.join(temp, name)
        owner = _owner_pid(path) if name.startswith(POOL_DIR_PREFIX) else None
        if owner is not None and not _pid_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else []:
        owner = segment_owner_pid(name)
        if owner is not None and not _pid_alive(owner):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
    return removed


def _exit_detail(code: int | None) -> str:
    if code is None:
        return "its connection closed while the process was still running"
    if code < 0:
        return f"the worker process was killed by {signal.Signals(-code).name}"
    return f"the worker process exited with code {code}"


class LocalWorkers:
    """Worker processes of one pool generation; ``kill`` or ``shutdown`` ends them all."""

    def __init__(self, config: ParallelConfig, pg_timeout_s: float, diagnostics: str | None):
        self.config = config
        # Fails here, before any process starts, on missing GPUs. Each worker's GPU list is set explicitly (a
        # host narrowed to one GPU, e.g. ComfyUI's --cuda-device, would otherwise narrow every worker too).
        self.device_env, self.devices = worker_device_env(config.rank_devices())
        self.pg_timeout_s = pg_timeout_s
        self.diagnostics = os.path.abspath(diagnostics) if diagnostics else None
        self.shm_prefix = new_segment_prefix()
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        sweep_stale_pool_files()
        # Made once the workers exist (_make_pool_folder): from then on a driver killed at any moment leaves
        # workers that remove it.
        self._tmpdir = os.path.join(tempfile.gettempdir(), POOL_DIR_PREFIX + secrets.token_hex(8))
        self._writer = ShmWriter(self.shm_prefix + "_d")
        self._reader = ShmReader()
        self._janitor = SegmentJanitor(self.shm_prefix)
        self._spawned = threading.Event()
        self._release = threading.Event()
        self._spawn_error: BaseException | None = None
        self._abandon = threading.Event()  # a cancelled start: fork no more workers

    # -- start -----------------------------------------------------------------------------------------------

    def start(self, timeout_s: float, should_cancel=None) -> None:
        self.start_timeout_s = timeout_s
        # Linux delivers the parent-death signal when the *thread* that forked a child ends, so the workers
        # are forked from a thread that lives exactly as long as this pool generation.
        threading.Thread(target=self._spawn_and_hold, name="wanmesh-pool-launcher", daemon=True).start()
        self._await_spawned(should_cancel)
        if self._spawn_error is not None:
            raise self._spawn_error
        self._await_hello(timeout_s, should_cancel)

    def _await_spawned(self, should_cancel=None) -> None:
        """Wait for the launcher (seconds when it waits for a cold worker template), polling ``should_cancel``;
        a cancel stops the launcher before its next fork and waits for it, so that no worker comes after."""
        try:
            while not self._spawned.wait(0.2):
                if should_cancel is not None and should_cancel():  # it may also raise the host's interrupt
                    raise Cancelled("starting the worker pool was cancelled")
        except BaseException:
            self._abandon.set()
            self._spawned.wait()
            raise

    def _spawn_and_hold(self) -> None:
        try:
            for rank in range(self.config.world):
                self._spawn(rank)
            self._make_pool_folder()
        except BaseException as exc:
            self._spawn_error = exc
        finally:
            self._spawned.set()
        self._release.wait()

    def _make_pool_folder(self) -> None:
        """The private folder of the ranks' file store, with its owner's pid inside (for the sweep); then each
        worker is told it exists."""
        os.mkdir(self._tmpdir, 0o700)  # fails on an existing name, like mkdtemp
        with open(os.path.join(self._tmpdir, OWNER_FILE), "w") as f:
            f.write(str(os.getpid()))
        for conn in self.conns:
            conn.send({"kind": "pool_folder_ready"})

    def _spawn(self, rank: int) -> None:
        ours, theirs = socket.socketpair()
        settings = {
            "rank": rank, "fd": theirs.fileno(), "parent_pid": os.getpid(), "config": self.config.to_dict(),
            "device": self.devices[rank], "store": os.path.join(self._tmpdir, "store"),
            "pg_timeout_s": self.pg_timeout_s, "diagnostics": self.diagnostics, "shm_prefix": self.shm_prefix,
            "pool_dir": self._tmpdir, "collective_timeout_s": self.config.worker_timeout,
        }
        env = {**os.environ, **LOOPBACK_ENV, **self.device_env}
        template = shared_template(TEMPLATE_BOOTSTRAP, PACK_DIR, self.start_timeout_s, self._abandon) \
            if template_wanted(self.devices) else None
        if self._abandon.is_set():
            theirs.close()
            ours.close()
            raise Cancelled("starting the worker pool was cancelled")
        try:
            if template is not None:
                try:
                    self.procs.append(template.spawn(settings, env, theirs.fileno()))
                    self.conns.append(Connection(ours.detach()))
                    return
                except TemplateGone:
                    pass  # it ended since it was ready: this worker starts the plain way
            proc = subprocess.Popen(
                # "--rank N" is for people reading `ps`; the worker reads its rank from the settings.
                [sys.executable, "-c", BOOTSTRAP, PACK_DIR, json.dumps(settings), "--rank", str(rank)],
                pass_fds=(theirs.fileno(),), env=env, start_new_session=True, stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        self.procs.append(proc)
        self.conns.append(Connection(ours.detach()))

    def _await_hello(self, timeout_s: float, should_cancel=None) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = set(range(self.config.world))
        while waiting:
            if should_cancel is not None and should_cancel():  # it may also raise the host's interrupt
                raise Cancelled("starting the worker pool was cancelled")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise P.WorkerError(min(waiting), "StartTimeout", f"ranks {sorted(waiting)} did not start within "
                                    f"{timeout_s:g} s (start_timeout_s); config {self.config.describe()}")
            try:
                arrived = self.poll(min(remaining, 0.2), only=waiting, starting=True)
            except RankDied as died:
                raise P.WorkerError(died.rank, "WorkerDied", f"{died.detail} (its standard error says why); "
                                    f"config {self.config.describe()}") from None
            for rank, message in arrived:
                if message["kind"] == "error":
                    raise P.WorkerError.from_wire(message)
                if message.get("protocol") != P.PROTOCOL_VERSION:
                    raise P.ProtocolError(f"rank {rank} speaks protocol {message.get('protocol')}, "
                                          f"the driver {P.PROTOCOL_VERSION}")
                waiting.discard(rank)

    # -- messages --------------------------------------------------------------------------------------------

    def prepare(self, request: P.Request) -> dict[str, Any]:
        """The request as plain data, its tensors copied into the driver's arena (read by every rank)."""
        self._writer.reserve(P.tensors_in(request))
        return P.encode_message(request, self._writer.pack)

    def send_request(self, request_id: int, body: dict[str, Any]) -> None:
        """The request to every rank; a rank whose pipe is closed is dead (killed between calls, before the pool's
        liveness check saw it) and raises RankDied, as poll() does, rather than the pipe's OSError."""
        for rank, conn in enumerate(self.conns):
            try:
                conn.send({"kind": "request", "id": request_id, "body": body})
            except OSError:
                raise RankDied(rank, _exit_detail(self._exit_code(rank))) from None

    def send_cancel(self, request_id: int) -> None:
        for conn in self.conns:
            try:
                conn.send({"kind": "cancel", "id": request_id})
            except OSError:
                pass  # a dead rank is reported by poll()

    def send_live(self, request_id: int, fields: dict[str, Any]) -> None:
        """Input for the running request, to rank 0 (which shares it with the others at a step boundary)."""
        try:
            self.conns[0].send({"kind": "live", "id": request_id, "fields": fields})
        except OSError:
            pass  # a dead rank is reported by poll()

    def poll(self, timeout_s: float, only: set[int] | None = None, starting: bool = False) -> list[tuple[int, dict]]:
        """Messages that arrived within ``timeout_s``; raises RankDied for a worker that is gone."""
        ranks = sorted(only) if only is not None else range(len(self.conns))
        by_conn = {self.conns[r]: r for r in ranks}
        messages = []
        for conn in wait(list(by_conn), timeout=timeout_s):
            rank = by_conn[conn]
            try:
                messages.append((rank, conn.recv()))
            except (EOFError, OSError):
                code = self._exit_code(rank)
                what = "while starting" if starting else ""
                raise RankDied(rank, f"{_exit_detail(code)} {what}".strip()) from None
        for rank in ranks:
            if not messages and self.procs[rank].poll() is not None:
                raise RankDied(rank, _exit_detail(self.procs[rank].returncode))
        return messages

    def check_alive(self) -> None:
        """Raise RankDied for the first worker process that has ended (the idle liveness check; reads nothing)."""
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise RankDied(rank, _exit_detail(proc.returncode))

    def _exit_code(self, rank: int) -> int | None:
        try:
            return self.procs[rank].wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return None

    def take_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A streaming chunk from a progress message, its tensors copied out of the segment rank 0 handed over."""
        return take_handed_over(chunk)

    def decode_reply(self, body: dict[str, Any]) -> P.Reply:
        names = segment_names(body)
        self._janitor.adopt(names)
        self._reader.forget_except(names)
        return P.decode_message(body, self._reader.copy)

    # -- stop ------------------------------------------------------------------------------------------------

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self, request_id: int) -> None:
        """Ask every rank to leave, wait briefly, then make sure."""
        try:
            for conn in self.conns:
                conn.send({"kind": "request", "id": request_id, "body": P.encode_message(P.Shutdown(), None)})
            deadline = time.monotonic() + SHUTDOWN_GRACE_S
            for proc in self.procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()

    def kill(self) -> None:
        """End every worker now and free what the pool generation held (sockets, store folder, segments)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for conn in self.conns:
            conn.close()
        self._release.set()
        self._writer.close()
        self._reader.close()
        self._janitor.clean()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
