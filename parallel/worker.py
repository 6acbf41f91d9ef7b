"""The worker side of the pool: one process per device, serving requests on an Engine.

A worker is started by the pool in a fresh interpreter, joins the pool's process group, says hello, then
serves requests until told to shut down. Every rank executes every request (they cooperate through the
process groups); only rank 0 sends the result back, the others acknowledge. A receiver thread reads the
connection so that a cancel arrives while a request runs, and the worker exits as soon as the driver goes
away (connection EOF, parent-death signal, or a changed parent pid), so no worker outlives its driver.

``WorkerRuntime`` knows nothing about connections; the local loop here and the Ray actor both drive it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from . import protocol as P
from .config import ParallelConfig
from .mesh import ParallelContext, init_distributed, single_rank_context
from .transport import ShmReader, ShmWriter

PR_SET_PDEATHSIG = 1
THREADS_ENV = "WANMESH_WORKER_THREADS"


@dataclass
class RequestContext:
    """What a request handler may use besides the request itself."""

    runtime: "WorkerRuntime"
    progress: Callable[[int, int], None]
    should_stop: Callable[[], bool]

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def parallel(self) -> ParallelContext:
        return self.runtime.parallel

    @property
    def engine(self):
        return self.runtime.engine


Handler = Callable[[RequestContext, Any], P.Reply]


# -- dispatch: protocol request -> Engine method ---------------------------------------------------------


def _sample(ctx: RequestContext, req: P.Sample) -> P.Latents:
    from .sampling import SampleRequest

    fields = {f.name: getattr(req, f.name) for f in dataclasses.fields(req) if f.name != "handle"}
    latents = ctx.engine.sample(req.handle, SampleRequest(**fields), progress=ctx.progress, should_stop=ctx.should_stop)
    return P.Latents(latents)


def _unload(ctx: RequestContext, req: P.Unload) -> P.Done:
    ctx.engine.unload(req.handle)
    return P.Done()


ENGINE_DISPATCH: dict[type[P.Request], Handler] = {
    P.LoadModel: lambda ctx, r: P.Loaded(ctx.engine.load_model(r.path, vace_module=r.vace_module, dtype=r.dtype)),
    P.LoadVae: lambda ctx, r: P.Loaded(ctx.engine.load_vae(r.path, dtype=r.dtype)),
    P.LoadTextEncoder: lambda ctx, r: P.Loaded(ctx.engine.load_text_encoder(r.path, dtype=r.dtype)),
    P.EncodeText: lambda ctx, r: P.Embeddings(ctx.engine.encode_text(r.handle, list(r.prompts))),
    P.Sample: _sample,
    P.Decode: lambda ctx, r: P.Images(ctx.engine.decode(r.handle, r.latents, r.tile_px, r.overlap_px)),
    P.Encode: lambda ctx, r: P.Latents(ctx.engine.encode(r.handle, r.frames, r.tile_px, r.overlap_px)),
    P.Unload: _unload,
}


def _echo(ctx: RequestContext, args: dict, tensors: list[torch.Tensor]) -> P.DiagnosticResult:
    return P.DiagnosticResult(tensors=tensors, info={"rank": ctx.rank})


BUILTIN_DIAGNOSTICS: dict[str, Callable[..., P.DiagnosticResult]] = {"echo": _echo}


def load_diagnostics(path: str | None) -> dict[str, Callable[..., P.DiagnosticResult]]:
    """Built-in diagnostic ops plus those in ``DIAGNOSTICS`` of the file at ``path`` (fault-injection tests)."""
    ops = dict(BUILTIN_DIAGNOSTICS)
    if path:
        spec = importlib.util.spec_from_file_location("wanmesh_worker_diagnostics", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        ops.update(module.DIAGNOSTICS)
    return ops


# -- the runtime ---------------------------------------------------------------------------------------


class StopFlags:
    """Request ids the driver asked to cancel, set from the receiver thread."""

    def __init__(self):
        self._ids: set[int] = set()
        self._lock = threading.Lock()

    def cancel(self, request_id: int) -> None:
        with self._lock:
            self._ids.add(request_id)

    def is_cancelled(self, request_id: int) -> bool:
        with self._lock:
            return request_id in self._ids

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._ids.discard(request_id)


class StopCheck:
    """The ``should_stop`` of one request. Every rank calls it at the same step boundaries, and an all-reduce
    makes them agree: one rank leaving the loop while another enters a collective would hang the pool."""

    def __init__(self, runtime: "WorkerRuntime", request_id: int):
        self.runtime = runtime
        self.request_id = request_id
        self.stopped = False

    def __call__(self) -> bool:
        parallel = self.runtime.parallel
        flag = torch.tensor([int(self.runtime.stops.is_cancelled(self.request_id))], device=parallel.device)
        if parallel.is_distributed and parallel.world > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        self.stopped = self.stopped or bool(flag.item())
        return self.stopped


class WorkerRuntime:
    """One rank's engine, process groups and request execution, independent of how requests arrive."""

    def __init__(self, parallel: ParallelContext, diagnostics: str | None = None):
        self.parallel = parallel
        self.rank = parallel.rank
        self.device = parallel.device
        self.stops = StopFlags()
        self._engine = None
        self._diagnostics = load_diagnostics(diagnostics)

    @property
    def engine(self):
        if self._engine is None:
            from .engine import Engine  # imported on first use: loading it pulls in diffusers

            self._engine = Engine(self.device, parallel=self.parallel)
        return self._engine

    def health(self) -> dict[str, Any]:
        loaded = self._engine.loaded() if self._engine is not None and hasattr(self._engine, "loaded") else []
        info = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "loaded": loaded,
                "protocol": P.PROTOCOL_VERSION, "torch": torch.__version__}
        if self.device.type == "cuda":
            info["memory_allocated"] = torch.cuda.memory_allocated(self.device)
        return info

    def execute(self, request: P.Request, request_id: int, progress: Callable[[int, int], None]) -> dict[str, Any]:
        """Run one request; the outcome as plain data: reply (rank 0's carries the result), cancelled or error."""
        should_stop = StopCheck(self, request_id)
        ctx = RequestContext(self, progress, should_stop)
        try:
            reply = self._dispatch(ctx, request)
        except Exception as exc:  # every failure goes back to the caller with its traceback
            if should_stop.stopped:  # whatever the handler raised on its way out of a cancelled run
                return {"kind": "cancelled", "rank": self.rank}
            error = P.WorkerError(self.rank, type(exc).__name__, str(exc), traceback.format_exc())
            return error.to_wire()
        finally:
            self.stops.forget(request_id)
        return {"kind": "reply", "rank": self.rank, "body": reply}

    def execute_wire(
        self,
        body: dict[str, Any],
        request_id: int,
        unpack: Callable[[Any], torch.Tensor],
        pack_reply: Callable[[P.Reply], dict[str, Any]],
        progress: Callable[[int, int], None],
    ) -> dict[str, Any]:
        """:meth:`execute` for a request in plain data; rank 0's reply is packed, the other ranks' dropped."""
        try:
            request = P.decode_message(body, unpack)
        except Exception as exc:
            return P.WorkerError(self.rank, type(exc).__name__, str(exc), traceback.format_exc()).to_wire()
        outcome = self.execute(request, request_id, progress)
        if outcome["kind"] == "reply" and isinstance(outcome["body"], P.Reply):
            outcome["body"] = pack_reply(outcome["body"]) if self.rank == 0 else None
        return outcome

    def _dispatch(self, ctx: RequestContext, request: P.Request) -> Any:
        if isinstance(request, P.Health):
            return self.health()
        if isinstance(request, P.Shutdown):
            return P.Done()
        if isinstance(request, P.Diagnostic):
            if request.op not in self._diagnostics:
                raise ValueError(f"unknown diagnostic op {request.op!r}; available: {', '.join(self._diagnostics)}")
            return self._diagnostics[request.op](ctx, dict(request.args), list(request.tensors)) or P.DiagnosticResult()
        handler = ENGINE_DISPATCH.get(type(request))
        if handler is None:
            raise P.ProtocolError(f"this worker cannot serve {type(request).__name__}")
        return handler(ctx, request)


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

    def _progress_sender(self, request_id: int) -> Callable[[int, int], None]:
        if self.runtime.rank != 0:
            return lambda step, total: None
        return lambda step, total: self.send({"kind": "progress", "id": request_id, "step": int(step), "total": int(total)})


def _configure_threads(device: torch.device, world: int) -> None:
    if device.type == "cpu":
        threads = int(os.environ.get(THREADS_ENV) or max(1, (os.cpu_count() or 1) // world))
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    """Entry point of a local worker process: ``argv[0]`` is the JSON settings written by the pool."""
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


def in_process_runtime(config: ParallelConfig, device: str = "cpu") -> WorkerRuntime:
    """A runtime without processes or groups (world 1), for callers that want the dispatch without a pool."""
    if config.world != 1:
        raise ValueError(f"an in-process runtime has one rank, config has world={config.world}")
    return WorkerRuntime(single_rank_context(config, torch.device(device)))
