"""Scaffolding shared by the tests that start real worker pools (tests/distributed, tests/faults); runs in the
test (driver) process: the tiny models under a module deadline, prompt embeddings from one in-process executor,
sample requests with seeded random embeddings, CPU pools, and waiting for worker processes to end."""

from __future__ import annotations

import contextlib
import faulthandler
from pathlib import Path

import psutil
import pytest
import torch

from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import WorkerPool
from wanmesh.parallel.protocol import SampleRequest

POOL_TIMEOUT_S = 300  # a pool call that takes longer than this on the tiny models is a failure
TINY_TEXT_DIM = 64  # the tiny text encoder's embedding width (TINY_TRANSFORMER["text_dim"])


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch):
    """Imported into a test module: each worker a test starts runs one CPU thread (pools started by fixtures of a
    wider scope start before it)."""
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")


@contextlib.contextmanager
def traceback_deadline(seconds: float):
    """Past ``seconds``, print every thread's traceback and end the test process: a hung pool fails the run with
    a trace instead of stalling it."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def tiny_model_paths(folder: Path) -> dict[str, str]:
    """The tiny models written into ``folder``, as path strings by role (t2v, vace, vae, text_encoder, ...)."""
    from wanmesh.parallel.tiny.models import make_tiny

    return {role: str(path) for role, path in make_tiny(folder).items()}


def tiny_models_within(tmp_path_factory, deadline_s: float, folder: str = "tiny"):
    """Body of a module fixture (``yield from``): the tiny models in a fresh folder, the whole module under one
    ``traceback_deadline``."""
    with traceback_deadline(deadline_s):
        yield tiny_model_paths(tmp_path_factory.mktemp(folder))


def embed_prompts(engine, text_encoder: str, *prompts: str) -> list[list[torch.Tensor]]:
    """Each prompt's embeddings from an in-process ``RankExecutor``'s text encoder, in the sampler's format."""
    text = engine.load_text_encoder(text_encoder)
    return [engine.encode_text(text, [prompt]) for prompt in prompts]


def random_prompt_request(latent: torch.Tensor, generator: torch.Generator, lengths: tuple[int, int] = (9, 4), *,
                          handle: str = "", **fields) -> SampleRequest:
    """A SampleRequest for the tiny models whose positive and negative embeddings are drawn from ``generator``
    (``lengths`` tokens each, in that order); ``fields``: the request's other fields (seed, steps, ...)."""
    positive, negative = (torch.randn(length, TINY_TEXT_DIM, generator=generator) for length in lengths)
    return SampleRequest(handle=handle, latent=latent, positive=[positive], negative=[negative], **fields)


def cpu_pool(*, diagnostics: str | None = None, **layout) -> WorkerPool:
    """A worker pool of CPU (gloo) ranks; ``layout`` holds the ParallelConfig fields (world, tp, ...)."""
    return WorkerPool(ParallelConfig(devices="cpu", **layout), timeout_s=POOL_TIMEOUT_S, diagnostics=diagnostics)


def wait_gone(pids: list[int], within_s: float) -> list[int]:
    """Wait for the processes to end; kill and return those still running after ``within_s``."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=within_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:
        proc.kill()
    return [p.pid for p in alive]
