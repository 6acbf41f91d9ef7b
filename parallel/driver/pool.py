"""The worker pool as the driver (ComfyUI or CLI process) sees it: start workers, hand them requests, relay
progress and cancel, survive faults.

``WorkerPool.call`` sends one typed request to every rank and waits for all of them, turning what comes back
into a typed reply (rank 0's), a :class:`WorkerError`, or :class:`Cancelled`. A rank that dies, raises
while the others wait on it, stops its heartbeat for ``config.worker_timeout`` seconds (it is named), or
sends nothing for ``timeout_s`` seconds stops the whole pool (a broken collective cannot be repaired); the
next call starts a fresh one and reloads the models the caller had loaded, so handles stay valid across
restarts. Errors that every rank reports leave the pool running. Between calls a liveness monitor thread
checks the local workers every second: a rank that dies while the pool is idle is logged (rank, exit code or
signal), the pool is stopped, and the next call raises ``WorkerDied`` naming it (the call after starts a fresh
pool). The driver never blocks on a worker for
longer than one short poll, so a cancel (or the host's interrupt) is seen within a fraction of a second: at
a step boundary when the ranks can stop there, else by stopping the pool.

Backends (``local.LocalWorkers``, ``ray_backend.RayWorkers``) start the workers and move messages;
the request discipline above is shared by both.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import threading
import time
import weakref
from typing import Any, Callable

from .. import protocol as P
from ..config import ParallelConfig, heartbeat_interval
from ..errors import Cancelled, RankDied, WorkerError

__all__ = ["WorkerPool", "WorkerError", "Cancelled", "get_pool", "close_cached_pool"]

ERROR_GRACE_S = 3.0  # after one rank fails, how long the others get to report before the pool is stopped
POLL_S = 0.05
CANCEL_GRACE_S = 2.0  # a cancelled request that cannot stop at a step boundary (a load) gets this long, then the pool stops
STALE_BEATS = 3  # a rank that missed this many heartbeats is the suspect when its peers fail waiting on it
EXIT_LOCK_S = 1.0  # at interpreter exit, how long to wait for a running call before asking it to stop
EXIT_STOP_S = 10.0  # then how long the call gets to stop its workers and end, before they are killed under it
SHUTTING_DOWN = "the server is shutting down"
IDLE_CHECK_S = 1.0  # how often the liveness monitor looks at idle workers
log = logging.getLogger("wanmesh.pool")
COOPERATIVE = (P.SampleRequest, P.Diagnostic)  # requests whose ranks check for a cancel at step boundaries
HANDLE_FIELDS = ("handle", "handle_low", "vae_handle")  # request fields naming resident models

Progress = Callable[..., None]  # (step, total), or (step, total, preview) when the request asked for previews


class _Transaction:
    """Book-keeping of one request across all ranks."""

    def __init__(self, world: int, request_id: int):
        self.request_id = request_id
        self.started = time.monotonic()
        self.last_beat = {rank: self.started for rank in range(world)}  # any message from the rank counts
        self.last_status: dict[int, dict[str, Any]] = {}  # each rank's latest heartbeat fields
        self.cancel_sent_at: float | None = None
        self.pending = set(range(world))
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.errors: list[WorkerError] = []  # in arrival order: the first is usually the cause
        self.first_error_at: float | None = None
        self.last_activity = time.monotonic()
        self.cancel_sent = False
        self.caller_exception: BaseException | None = None

    def beat(self, rank: int, message: dict[str, Any]) -> None:
        self.last_beat[rank] = time.monotonic()
        if message["kind"] in ("heartbeat", "progress"):
            status = self.last_status.setdefault(rank, {})
            status.update({k: message[k] for k in ("phase", "step", "total") if message.get(k) is not None})

    def status_of(self, rank: int) -> dict[str, Any] | None:
        """The rank's last heartbeat fields; its step falls back to the pool's last progress step (rank 0's),
        when the rank went silent before its own heartbeat carried one."""
        own, pool_wide = self.last_status.get(rank) or {}, self.last_status.get(0) or {}
        if own.get("step") is None and pool_wide.get("step") is not None:
            return {**own, "step": pool_wide["step"], "total": pool_wide.get("total")}
        return own or None

    def silent_for(self, rank: int, now: float) -> float:
        return now - self.last_beat[rank]

    def silent_ranks(self, now: float, limit_s: float) -> list[int]:
        """The pending ranks, lowest first, that have sent nothing for more than ``limit_s``."""
        return [rank for rank in sorted(self.pending) if self.silent_for(rank, now) > limit_s]

    def record(self, rank: int, message: dict[str, Any]) -> None:
        self.last_activity = time.monotonic()
        self.outcomes[rank] = message
        self.pending.discard(rank)
        if message["kind"] == "error":
            self.errors.append(WorkerError.from_wire(message))
            self.first_error_at = self.first_error_at or time.monotonic()


class WorkerPool:
    """A pool of worker processes (or Ray actors) shaped by a ParallelConfig. Use as a context manager.

    ``timeout_s``: the longest a request may go without any sign of life from the workers (a progress step
    or a reply) before it is declared hung. ``start_timeout_s``: how long starting the workers may take.
    ``diagnostics``: path of a file whose ``DIAGNOSTICS`` ops the workers also serve (tests only).
    ``start``: start the workers now; False leaves that to the first call (the Pool node: the loaders' header
    checks against the pool's settings then refuse a model before any worker exists).
    """

    def __init__(
        self,
        config: ParallelConfig,
        *,
        timeout_s: float = 600.0,
        start_timeout_s: float = 300.0,
        pg_timeout_s: float = 1800.0,
        diagnostics: str | None = None,
        start: bool = True,
    ):
        if timeout_s <= 0 or start_timeout_s <= 0:
            raise ValueError(f"timeouts must be positive, got timeout_s={timeout_s}, start_timeout_s={start_timeout_s}")
        self.config = config
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.pg_timeout_s = pg_timeout_s
        self.diagnostics = diagnostics
        self.options = dict(timeout_s=timeout_s, start_timeout_s=start_timeout_s, pg_timeout_s=pg_timeout_s,
                            diagnostics=diagnostics)  # what get_pool needs to start this pool again
        self.starts = 0  # how many times workers were started (restarts after faults count)
        self._backend = None
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._loads: dict[str, P.Request] = {}  # handle -> the load request that made it
        self._resident: set[str] = set()  # handles loaded in the current workers
        self._closed = False
        self._idle_death: WorkerError | None = None  # a rank the liveness monitor found dead, raised by the next call
        self._stop_reason: str | None = None  # set by stop_running_call: the running call stops its workers and ends
        if start:
            self._start(_interrupt_check)
        threading.Thread(target=_watch_idle, args=(weakref.ref(self),), name="wanmesh-pool-monitor", daemon=True).start()

    # -- life cycle -----------------------------------------------------------------------------------------

    def _make_backend(self):
        if self.config.backend == "ray":
            from .ray_backend import RayWorkers

            return RayWorkers(self.config, self.pg_timeout_s, self.diagnostics)
        from .local import LocalWorkers

        return LocalWorkers(self.config, self.pg_timeout_s, self.diagnostics)

    def _start(self, should_cancel: Callable[[], bool] | None = None) -> None:
        backend = self._make_backend()
        try:
            backend.start(self.start_timeout_s, should_cancel)
        except BaseException:
            backend.kill()
            raise
        self._backend = backend
        self._resident = set()
        self.starts += 1

    def _discard_workers(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            backend.kill()
        self._resident = set()

    def close(self) -> None:
        """Shut the workers down (gracefully, then by force); the pool cannot be used afterwards."""
        with self._lock:
            self._closed = True
            if self._backend is not None:
                backend, self._backend = self._backend, None
                backend.shutdown(next(self._ids))

    def recycle(self) -> None:
        """Let the workers go: they shut down (gracefully, then by force), so everything they held goes back to the
        system, model code and allocator caches included (and GPU contexts); the next request starts fresh ones
        with the same settings, and models known to the pool load again when a request names them."""
        with self._lock:
            if self._closed or self._backend is None:
                return
            backend, self._backend = self._backend, None
            backend.shutdown(next(self._ids))
            self._resident = set()

    def stop_running_call(self, reason: str) -> None:
        """Make a call running in another thread stop its workers and end within one poll, raising ``PoolStopped``
        that names ``reason`` (interpreter exit: the caller's own error report then says why); the pool is closed."""
        self._stop_reason = reason

    @property
    def busy(self) -> bool:
        """Whether a call is running (in any thread)."""
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    def _stopped_error(self) -> WorkerError:
        return WorkerError(None, "PoolStopped", f"the worker pool was stopped because {self._stop_reason}")

    def unload_models(self) -> bool:
        """Every rank frees its resident models (weights, allocator caches; on GPUs the reserved memory) and stays
        up; the pool remembers how each model was loaded, so the next request naming one loads it again (a weight
        load, not a pool start). False when no workers run."""
        with self._lock:
            if self._closed or self._backend is None:
                return False
            self._call_started(P.Unload(handle=None), None, None, self.timeout_s)
            self._resident = set()  # the next request that names a model sends its load again
            return True

    def kill_now(self) -> None:
        """End the workers at once without waiting for a running call (interpreter exit, signals)."""
        self._closed = True
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.kill()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._backend is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def adopt_loads(self, other: "WorkerPool") -> None:
        """Know the models ``other`` (a closed pool) had loaded: their handles load here on first use."""
        with self._lock:
            for handle, request in other._loads.items():
                self._loads.setdefault(handle, request)

    def pids(self) -> list[int]:
        """Process ids of the local workers (empty for Ray or when stopped)."""
        return self._backend.pids() if self._backend is not None else []

    # -- requests -------------------------------------------------------------------------------------------

    def health(self) -> P.HealthReport:
        return self.call(P.Health())

    def call(
        self,
        request: P.Request,
        *,
        progress: Progress | None = None,
        should_cancel: Callable[[], bool] | None = None,
        timeout_s: float | None = None,
        live_inputs: Callable[[], list[dict]] | None = None,
    ) -> P.Reply:
        """Run ``request`` on every rank; rank 0's typed reply. Raises WorkerError or Cancelled. ``live_inputs``,
        polled while the request runs, gives fields sent to rank 0 as ``live`` messages (a stream's posted
        prompts, ``live_prompts.py``)."""
        if not isinstance(request, P.Request) or type(request).kind not in P.REQUESTS:
            raise TypeError(f"call() takes a protocol request ({', '.join(P.REQUESTS)}), got {type(request).__name__}")
        if isinstance(request, P.Shutdown):
            raise ValueError("stop the pool with close(), not a Shutdown request")
        should_cancel = should_cancel or _interrupt_check
        with self._lock:
            if self._stop_reason is not None:
                raise self._stopped_error()
            if self._closed:
                raise RuntimeError("this WorkerPool was closed; get a new one (get_pool starts one)")
            if self._idle_death is not None:
                error, self._idle_death = self._idle_death, None
                raise error
            if self._backend is None:
                self._start(should_cancel)
            self._reload_if_needed(request, should_cancel)
            reply = self._call_started(request, progress, should_cancel, timeout_s or self.timeout_s, live_inputs)
            self._note_residency(request, reply)
            return reply

    def check_idle(self) -> bool:
        """The liveness check between calls: when no call runs and a worker has ended, log it, stop the pool and
        keep the error for the next call. False once the pool is closed (the monitor then ends)."""
        if self._closed:
            return False
        if not self._lock.acquire(blocking=False):
            return True  # a call is running: it watches the ranks itself
        try:
            backend = self._backend
            if backend is None or not hasattr(backend, "check_alive"):
                return not self._closed
            try:
                backend.check_alive()
            except RankDied as died:
                log.warning("WanMesh pool: rank %d died while the pool was idle (%s); the next request reports it "
                            "and the one after starts a fresh pool", died.rank, died.detail)
                self._discard_workers()
                self._idle_death = WorkerError(died.rank, "WorkerDied", f"{died.detail} while the pool was idle; the "
                                               "pool was stopped and the next request starts a fresh one")
            return not self._closed
        finally:
            self._lock.release()

    def _reload_if_needed(self, request: P.Request, should_cancel=None) -> None:
        """After a restart, reload the models a request refers to, as the caller loaded them before."""
        if isinstance(request, P.Unload):
            return
        for field in HANDLE_FIELDS:
            handle = getattr(request, field, None)
            if handle and handle in self._loads and handle not in self._resident:
                self._call_started(self._loads[handle], None, should_cancel, self.timeout_s)
                self._resident.add(handle)

    def _note_residency(self, request: P.Request, reply: P.Reply) -> None:
        if isinstance(request, P.LOADS) and isinstance(reply, P.Loaded):
            self._loads[reply.handle] = request
            self._resident.add(reply.handle)
        elif isinstance(request, P.Unload):
            forget = list(self._loads) if request.handle is None else [request.handle]
            for handle in forget:
                self._loads.pop(handle, None)
                self._resident.discard(handle)

    def _call_started(self, request, progress, should_cancel, timeout_s, live_inputs=None) -> P.Reply:
        backend = self._backend
        body = backend.prepare(request)  # a request that cannot be sent fails here and leaves the pool as it is
        txn = _Transaction(self.config.world, next(self._ids))
        try:
            backend.send_request(txn.request_id, body)
            while txn.pending:
                self._step(backend, txn, request, progress, should_cancel, timeout_s, live_inputs)
        except RankDied as died:
            self._discard_workers()
            if self._stop_reason is not None:
                raise self._stopped_error() from None
            raise WorkerError(died.rank, "WorkerDied", f"{died.detail} during {request.kind}; the pool was stopped "
                              "and the next request starts a fresh one") from None
        except BaseException:
            self._discard_workers()  # interrupted mid-request (e.g. Ctrl-C): the ranks' state is unknown
            raise
        return self._conclude(backend, txn, request)

    def _step(self, backend, txn: _Transaction, request, progress, should_cancel, timeout_s, live_inputs=None) -> None:
        if self._stop_reason is not None:  # _call_started stops the workers in this thread
            self._closed = True
            raise self._stopped_error()
        self._maybe_cancel(backend, txn, should_cancel)
        if live_inputs is not None and not txn.cancel_sent:
            for fields in live_inputs():
                backend.send_live(txn.request_id, fields)
        for rank, message in backend.poll(POLL_S):
            if message.get("chunk") is not None:  # taken over at once, also a late one, so no segment is left
                message["chunk"] = backend.take_chunk(message["chunk"])
            if message.get("id") != txn.request_id:
                continue  # late news from an earlier, abandoned request
            txn.beat(rank, message)
            if message["kind"] == "heartbeat":
                continue
            if message["kind"] == "progress":
                txn.last_activity = time.monotonic()
                self._report_progress(backend, txn, progress, message)
            else:
                txn.record(rank, message)
        now = time.monotonic()
        if not txn.pending:
            return
        self._check_stuck(txn, request, now, self.config.worker_timeout)
        if txn.first_error_at is not None and now - txn.first_error_at > ERROR_GRACE_S:
            self._check_stuck(txn, request, now, STALE_BEATS * heartbeat_interval(self.config.worker_timeout))
            self._discard_workers()
            first = txn.errors[0]
            raise WorkerError(first.rank, first.error_type, first.message + f" (ranks {sorted(txn.pending)} were left "
                              "waiting on it; the pool was stopped)", first.traceback)
        self._check_cancel_overdue(txn, request, now)
        if now - txn.last_activity > timeout_s:
            self._discard_workers()
            raise WorkerError(min(txn.pending), "Timeout", f"ranks {sorted(txn.pending)} sent nothing for {timeout_s:g} s "
                              f"during {request.kind} (timeout_s={timeout_s:g}); the pool was stopped and the next "
                              "request starts a fresh one")

    def _check_stuck(self, txn: _Transaction, request, now: float, silent_limit: float) -> None:
        """Stop the pool and name the first pending rank whose heartbeat has been silent past ``silent_limit``."""
        silent = txn.silent_ranks(now, silent_limit)
        if not silent:
            return
        self._discard_workers()
        rank = silent[0]
        raise WorkerError(rank, "WorkerStuck", f"rank {rank} stopped answering for {txn.silent_for(rank, now):.0f} s "
                          f"during {_where(txn.status_of(rank), request)}; the pool was stopped and restarts on "
                          f"next use; raise worker_timeout (now {self.config.worker_timeout:g} s) if the model is "
                          "just slow")

    def _check_cancel_overdue(self, txn: _Transaction, request, now: float) -> None:
        """A cancel the ranks cannot honour soon (a load, or a rank stuck) stops the pool instead."""
        if txn.cancel_sent_at is None:
            return
        waited = now - txn.cancel_sent_at
        cooperative = isinstance(request, COOPERATIVE)
        stuck = txn.silent_ranks(now, STALE_BEATS * heartbeat_interval(self.config.worker_timeout))
        if (cooperative and not stuck and waited < self.config.worker_timeout) or waited < CANCEL_GRACE_S:
            return
        self._discard_workers()
        if txn.caller_exception is not None:
            raise txn.caller_exception
        why = f"rank {stuck[0]} is not answering" if stuck else f"{request.kind} cannot stop part-way"
        raise Cancelled(f"{request.kind} was cancelled; {why}, so the pool was stopped and restarts on next use")

    def _maybe_cancel(self, backend, txn: _Transaction, should_cancel) -> None:
        if txn.cancel_sent or should_cancel is None:
            return
        try:
            wanted = should_cancel()
        except BaseException as exc:  # e.g. the host's own interrupt exception: stop the workers, re-raise later
            txn.caller_exception, wanted = exc, True
        if wanted:
            backend.send_cancel(txn.request_id)
            txn.cancel_sent, txn.cancel_sent_at = True, time.monotonic()

    def _report_progress(self, backend, txn: _Transaction, progress, message) -> None:
        if progress is None or txn.caller_exception is not None:
            return
        try:
            if message.get("chunk") is not None:  # a finished streaming chunk (only stream requests send them)
                progress(message["step"], message["total"], chunk=message["chunk"])
            elif message.get("event") is not None:  # a stream's event (a posted prompt applied)
                progress(message["step"], message["total"], event=message["event"])
            elif message.get("preview") is None:
                progress(message["step"], message["total"])
            else:  # a preview comes only when the request asked for one, so the callback takes it
                progress(message["step"], message["total"], message["preview"])
        except BaseException as exc:
            txn.caller_exception = exc
            if not txn.cancel_sent:
                backend.send_cancel(txn.request_id)
                txn.cancel_sent, txn.cancel_sent_at = True, time.monotonic()

    def _conclude(self, backend, txn: _Transaction, request: P.Request) -> P.Reply:
        if txn.caller_exception is not None:
            raise txn.caller_exception
        if txn.errors:
            raise txn.errors[0]
        if any(o["kind"] == "cancelled" for o in txn.outcomes.values()):
            raise Cancelled(f"{request.kind} was cancelled; the workers stopped at a step boundary")
        if isinstance(request, P.Health):
            return P.HealthReport(ranks=[txn.outcomes[r]["body"] for r in sorted(txn.outcomes)])
        reply = backend.decode_reply(txn.outcomes[0]["body"])
        expected = P.REPLY_TO[type(request)]
        if not isinstance(reply, expected):
            raise P.ProtocolError(f"{request.kind} was answered with {reply.kind}, expected {expected.kind}")
        return reply


def _where(status: dict[str, Any] | None, request: P.Request) -> str:
    """'sample step 3/8' from a rank's last heartbeat, or the request's kind when it reported no step."""
    status = status or {}
    phase = status.get("phase") or request.kind
    if status.get("step") is not None and status.get("total") is not None:
        return f"{phase} step {status['step']}/{status['total']}"
    return f"{phase} (no step reported yet)" if isinstance(request, COOPERATIVE) else phase


def _watch_idle(pool_ref: "weakref.ref[WorkerPool]") -> None:
    """The liveness monitor's loop; it holds the pool only weakly, so an abandoned pool can still be collected."""
    while True:
        time.sleep(IDLE_CHECK_S)
        pool = pool_ref()
        if pool is None or not pool.check_idle():
            return
        del pool


# -- the host's interrupt ---------------------------------------------------------------------------------

_interrupt_check: Callable[[], bool] | None = None


def set_interrupt_check(check: Callable[[], bool] | None) -> None:
    """The host's interrupt (ComfyUI's), polled by every call that was given no ``should_cancel``: pool
    start, model loading and the other requests. It returns True or raises the host's own exception."""
    global _interrupt_check
    _interrupt_check = check


# -- one pool per process ---------------------------------------------------------------------------------

_cache_lock = threading.Lock()
_cached_pool: WorkerPool | None = None


def get_pool(config: ParallelConfig, **options: Any) -> WorkerPool:
    """The process-wide pool: the same config gives the same live pool; a changed config restarts it."""
    global _cached_pool
    with _cache_lock:
        if _cached_pool is not None and not _cached_pool._closed and _cached_pool.config == config:
            return _cached_pool
        check_can_start(config)  # what fails at once fails here, before the live pool is closed
        close_cached_pool_locked()
        _cached_pool = WorkerPool(config, **options)
        return _cached_pool


def check_can_start(config: ParallelConfig) -> None:
    """A device list this machine lacks (local); Ray missing, or its address not answering (ray)."""
    if config.backend == "local":
        config.rank_devices()
    else:
        from .ray_backend import check_ray_can_start

        check_ray_can_start(config)


def current_pool() -> WorkerPool | None:
    """The live process-wide pool, if one was started and not closed."""
    with _cache_lock:
        if _cached_pool is not None and not _cached_pool._closed:
            return _cached_pool
        return None


def close_cached_pool_locked() -> None:
    global _cached_pool
    if _cached_pool is not None:
        pool, _cached_pool = _cached_pool, None
        pool.close()


def close_cached_pool() -> None:
    with _cache_lock:
        close_cached_pool_locked()


def close_cached_pool_at_exit() -> None:
    """Interpreter exit (Ctrl-C in ComfyUI): close the pool, but never wait long on a call that is still
    running in another thread (it holds the pool's lock until sampling ends): that call is asked to stop its
    workers in its own thread and end with ``PoolStopped`` (server shutting down), so nothing is torn down under
    it while it runs; only a call that does not end in ``EXIT_STOP_S`` has its workers killed from here."""
    locked = _cache_lock.acquire(timeout=EXIT_LOCK_S)  # without it (a get_pool still running), read it anyway
    pool = _cached_pool
    if locked:
        _cache_lock.release()
    if pool is None or (pool._closed and pool._backend is None):
        return
    if not pool._lock.acquire(timeout=EXIT_LOCK_S):
        pool.stop_running_call(SHUTTING_DOWN)
        if not pool._lock.acquire(timeout=EXIT_STOP_S):
            pool.kill_now()
            return
    try:
        pool.close()
    finally:
        pool._lock.release()


atexit.register(close_cached_pool_at_exit)
