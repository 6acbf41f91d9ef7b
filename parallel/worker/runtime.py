"""One rank's request execution, independent of how requests arrive; runs in a worker process (or Ray actor).

Every rank executes every request (they cooperate through the process groups); only rank 0's reply carries
the result. ``WorkerRuntime`` knows nothing about connections: the local worker loop (``main.py``) and the
Ray actor (``driver/ray_backend.py``) both drive it. Requests are dispatched to this rank's
``RankExecutor`` (``executors.py``); cancel is a collective stop check at step boundaries.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .. import protocol as P
from ..distributed.mesh import ParallelContext

THREADS_ENV = "WANMESH_WORKER_THREADS"
# The model code a worker imports when it starts (``WorkerRuntime.preload_model_code``), besides its executor
# (which pulls in diffusers' Wan transformer and VAE, umT5 and the sampling loop): what the first text-to-video
# prompt imports otherwise, LoRA merging included.
PRELOADED_MODULES = ("..networks.umt5", ".lora_merge")

log = logging.getLogger(__name__)


@dataclass
class RequestContext:
    """What a request handler may use besides the request itself."""

    runtime: "WorkerRuntime"
    progress: Callable[[int, int], None]
    should_stop: Callable[[], bool]
    live_prompt: Callable[[], str | None] = lambda: None

    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def parallel(self) -> ParallelContext:
        return self.runtime.parallel

    @property
    def executor(self):
        return self.runtime.executor


Handler = Callable[[RequestContext, Any], P.Reply]


# -- dispatch: protocol request -> RankExecutor method ---------------------------------------------------


def _unload(ctx: RequestContext, req: P.Unload) -> P.Done:
    ctx.executor.unload(req.handle)
    return P.Done()


def _vace_encoded(result) -> P.VaceEncoded | None:
    return None if result is None else P.VaceEncoded(*result)


EXECUTOR_DISPATCH: dict[type[P.Request], Handler] = {
    P.LoadModel: lambda ctx, r: P.Loaded(ctx.executor.load_model(r.path, vace_module=r.vace_module, dtype=r.dtype,
                                                                     weights=r.weights)),
    P.LoadVae: lambda ctx, r: P.Loaded(ctx.executor.load_vae(r.path, dtype=r.dtype)),
    P.LoadTextEncoder: lambda ctx, r: P.Loaded(ctx.executor.load_text_encoder(r.path, dtype=r.dtype)),
    P.EncodeText: lambda ctx, r: P.Embeddings(ctx.executor.encode_text(r.handle, list(r.prompts))),
    P.SampleRequest: lambda ctx, r: ctx.executor.sample_latents(r, progress=ctx.progress, should_stop=ctx.should_stop),
    P.EncodeVace: lambda ctx, r: _vace_encoded(ctx.executor.encode_vace(r)),
    P.Decode: lambda ctx, r: P.Images(ctx.executor.decode(r.handle, r.latents, r.tile_px, r.overlap_px)),
    P.Encode: lambda ctx, r: P.Latents(ctx.executor.encode(r.handle, r.frames, r.tile_px, r.overlap_px)),
    P.Unload: _unload,
    P.ModelForward: lambda ctx, r: P.Latents(ctx.executor.forward(r, should_stop=ctx.should_stop)),
    P.StreamSample: lambda ctx, r: P.Streamed(*ctx.executor.stream(r, progress=ctx.progress, should_stop=ctx.should_stop,
                                                                   live_prompt=ctx.live_prompt),
                                              cache_report=ctx.executor.last_cache_report),
    P.Calibrate: lambda ctx, r: _calibrate(ctx),
}


def _calibrate(ctx: RequestContext) -> P.Calibrated:
    """Every rank measures at once (``calibration.measure_rank``); rank 0 replies with all ranks' figures."""
    from ..calibration import measure_rank

    figures = measure_rank(ctx.parallel.world, ctx.parallel.device)
    if ctx.parallel.world == 1:
        return P.Calibrated([figures])
    import torch.distributed as dist

    gathered: list = [None] * ctx.parallel.world
    dist.all_gather_object(gathered, figures)
    return P.Calibrated(gathered)


def _echo(ctx: RequestContext, args: dict, tensors: list[torch.Tensor]) -> P.DiagnosticResult:
    return P.DiagnosticResult(tensors=tensors, info={"rank": ctx.rank})


def _modules(ctx: RequestContext, args: dict, tensors: list[torch.Tensor]) -> P.DiagnosticResult:
    """The names of the modules this worker process has loaded (the process-boundary test reads them)."""
    return P.DiagnosticResult(info={"rank": ctx.rank, "modules": sorted(sys.modules)})


BUILTIN_DIAGNOSTICS: dict[str, Callable[..., P.DiagnosticResult]] = {"echo": _echo, "modules": _modules}


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


class StepReporter:
    """Rank 0's per-step progress to the driver, carrying the step's preview image when one was attached.

    ``send`` takes the message's fields (``step``, ``total``, optional ``preview``); other ranks get ``None``
    and report nothing. Previews are small uint8 arrays (latent resolution), so they travel with the message."""

    def __init__(self, send: Callable[[dict[str, Any]], None] | None, status: "WorkStatus | None" = None):
        self._send = send
        self._preview = None
        self._last = (0, 0)
        self._status = status  # every rank records its step here, for its heartbeat

    def attach_preview(self, image) -> None:
        self._preview = image

    def send_chunk(self, chunk: dict[str, Any]) -> None:
        """A finished streaming chunk (index, start frame, raw latents and decoded frames as CPU tensors), sent at
        once with the last step's numbers; the pool hands it to the caller's progress callback as ``chunk``."""
        if self._send is not None:
            self._send({"step": self._last[0], "total": self._last[1], "chunk": chunk})

    def send_event(self, event: dict[str, Any]) -> None:
        """A stream's event (a posted prompt applied), sent at once with the last step's numbers; the pool hands it
        to the caller's progress callback as ``event``."""
        if self._send is not None:
            self._send({"step": self._last[0], "total": self._last[1], "event": event})

    def __call__(self, step: int, total: int) -> None:
        self._last = (int(step), int(total))
        if self._status is not None:
            self._status.step(step, total)
        if self._send is None:
            return
        fields: dict[str, Any] = {"step": int(step), "total": int(total)}
        if self._preview is not None:
            fields["preview"], self._preview = self._preview, None
        self._send(fields)


class WorkStatus:
    """What this rank is doing now (request id and kind, last step), read by its heartbeat thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._current: dict[str, Any] | None = None

    def begin(self, request_id: int, kind: str) -> None:
        with self._lock:
            self._current = {"id": request_id, "phase": kind, "step": None, "total": None}

    def step(self, step: int, total: int) -> None:
        with self._lock:
            if self._current is not None:
                self._current.update(step=int(step), total=int(total))

    def end(self) -> None:
        with self._lock:
            self._current = None

    def snapshot(self) -> dict[str, Any] | None:
        """A copy of the current request's fields, or None between requests."""
        with self._lock:
            return dict(self._current) if self._current is not None else None


def beat_forever(status: WorkStatus, interval_s: float, send: Callable[[dict[str, Any]], None]) -> None:
    """A heartbeat thread's loop: while a request runs, pass ``status``'s fields (request, phase, last step) to
    ``send`` every ``interval_s``. It runs while the compute thread waits in a collective or a long operation,
    so a stopped or wedged process falls silent, which is how the driver tells the stuck rank from its peers."""
    while True:
        time.sleep(interval_s)
        current = status.snapshot()
        if current is not None:
            send(current)


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


class LiveInputs:
    """Input the driver sent for a running request (``live`` messages, to rank 0), set from the receiver thread."""

    def __init__(self):
        self._fields: dict[int, list[dict]] = {}
        self._lock = threading.Lock()

    def put(self, request_id: int, fields: dict) -> None:
        with self._lock:
            self._fields.setdefault(request_id, []).append(fields)

    def take_first(self, request_id: int) -> dict | None:
        with self._lock:
            waiting = self._fields.get(request_id)
            return waiting.pop(0) if waiting else None

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._fields.pop(request_id, None)


class LivePromptCheck:
    """The ``live_prompt`` of one request: the oldest prompt posted to rank 0 and not yet taken, or None. Every rank
    calls it at the same chunk boundaries and rank 0's answer is broadcast, so all switch at the same chunk."""

    def __init__(self, runtime: "WorkerRuntime", request_id: int):
        self.runtime = runtime
        self.request_id = request_id

    def __call__(self) -> str | None:
        fields = self.runtime.live.take_first(self.request_id) if self.runtime.rank == 0 else None
        taken = [None if fields is None else str(fields["prompt"])]
        parallel = self.runtime.parallel
        if parallel.is_distributed and parallel.world > 1:
            torch.distributed.broadcast_object_list(taken, src=0)
        return taken[0]


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
        self.live = LiveInputs()
        self.status = WorkStatus()
        self._executor = None
        self._diagnostics = load_diagnostics(diagnostics)

    def preload_model_code(self) -> None:
        """Import the model code this rank will run (diffusers, transformers, the executor) now, when the
        worker starts, rather than on the first request: a fresh worker then already holds the code it runs (so
        ComfyUI's "unload models" brings a worker back to the size of a fresh one), and the first prompt does
        not pay the imports. A failure is logged and left to the request that needs the code to report."""
        try:
            self.executor
            for name in PRELOADED_MODULES:
                importlib.import_module(name, __package__)
        except Exception as exc:  # noqa: BLE001 - the request that needs the code raises it in full
            log.warning("rank %d: could not import the model code at start (%s: %s)", self.rank,
                        type(exc).__name__, exc)
        # The imported code is about 450,000 objects that live as long as the process: moved out of the
        # collector's sight, a full collection (every unload runs one, residency.py) takes microseconds instead of
        # about 0.5 s of CPU. Objects made from here on (models, requests) are collected as before.
        gc.freeze()

    @property
    def executor(self):
        if self._executor is None:
            from .executors import RankExecutor  # imported by preload_model_code: loading it pulls in diffusers

            self._executor = RankExecutor(self.device, parallel=self.parallel)
        return self._executor

    def health(self) -> dict[str, Any]:
        loaded = self._executor.loaded() if self._executor is not None else []
        info = {"rank": self.rank, "pid": os.getpid(), "device": str(self.device), "loaded": loaded,
                "protocol": P.PROTOCOL_VERSION, "torch": torch.__version__,
                # the GPUs this rank was given, as it sees them (a forked worker's /proc environ is its template's)
                "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}
        if self.device.type == "cuda":
            info["memory_allocated"] = torch.cuda.memory_allocated(self.device)
        return info

    def execute(self, request: P.Request, request_id: int, progress: Callable[[int, int], None]) -> dict[str, Any]:
        """Run one request; the outcome as plain data: reply (rank 0's carries the result), cancelled or error."""
        should_stop = StopCheck(self, request_id)
        ctx = RequestContext(self, progress, should_stop, LivePromptCheck(self, request_id))
        self.status.begin(request_id, request.kind)
        try:
            reply = self._dispatch(ctx, request)
        except Exception as exc:  # every failure goes back to the caller with its traceback
            if should_stop.stopped:  # whatever the handler raised on its way out of a cancelled run
                return {"kind": "cancelled", "rank": self.rank}
            error = P.WorkerError(self.rank, type(exc).__name__, str(exc), traceback.format_exc())
            return error.to_wire()
        finally:
            self.stops.forget(request_id)
            self.live.forget(request_id)
            self.status.end()
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
        handler = EXECUTOR_DISPATCH.get(type(request))
        if handler is None:
            raise P.ProtocolError(f"this worker cannot serve {type(request).__name__}")
        return handler(ctx, request)
