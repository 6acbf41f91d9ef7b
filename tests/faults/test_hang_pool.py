"""Hangs in a real 2-rank pool (CPU, gloo): a rank stopped with SIGSTOP during sampling is named within the
worker timeout, the pool restarts and samples exactly as a fresh single-device run; a cancel during a hang,
during a model load and during pool start returns within seconds.

Time limits here are deadlines for the failure to be reported, not performance assertions.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

from pathlib import Path

import psutil
import pytest
import torch

from pool_helpers import cpu_pool, embed_prompts, tiny_models_within, wait_gone
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.driver import pool as pool_module
from wanmesh.parallel.driver.pool import Cancelled, WorkerError, WorkerPool
from wanmesh.parallel.driver import worker_template

DIAGNOSTICS = str(Path(__file__).with_name("hang_diagnostics.py"))
WORKER_TIMEOUT_S = 6.0
REPORTED_WITHIN_S = 20.0  # the stuck rank must be named well before this (worker_timeout + polling)
CANCEL_WITHIN_S = 10.0  # a cancel must return well before the 60 s worker timeout of the cancel pool
MODULE_DEADLINE_S = 400
SAMPLE = dict(seed=11, guidance_scale=4.0, shift=3.0, sampler="unipc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    os.environ["WANMESH_WORKER_THREADS"] = "1"
    yield from tiny_models_within(tmp_path_factory, MODULE_DEADLINE_S)


@pytest.fixture(scope="module")
def reference(tiny):
    """Prompt embeddings and a 2-step sample from one in-process executor (no pool, no processes)."""
    from wanmesh.parallel.worker.executors import RankExecutor

    engine = RankExecutor("cpu")
    positive, negative = embed_prompts(engine, tiny["text_encoder"], "a fox", "")
    request = P.SampleRequest(engine.load_model(tiny["t2v"]), torch.zeros(latent_shape(32, 32, 5)), positive,
                              negative, steps=2, **SAMPLE)
    return {"positive": positive, "negative": negative, "latents": engine.sample(request)}


def _pool(worker_timeout: float) -> WorkerPool:
    return cpu_pool(world=2, tp=2, worker_timeout=worker_timeout, diagnostics=DIAGNOSTICS)


@pytest.fixture(scope="module")
def stuck_pool(tiny):
    with _pool(WORKER_TIMEOUT_S) as pool:
        yield pool


@pytest.fixture(scope="module")
def patient_pool(tiny):
    """A pool whose worker timeout is far away: only the cancel can end a hang within the test's deadline."""
    with _pool(60.0) as pool:
        yield pool


def _request(handle: str, reference, steps: int) -> P.SampleRequest:
    return P.SampleRequest(handle, torch.zeros(latent_shape(32, 32, 5)), reference["positive"],
                           reference["negative"], steps=steps, **SAMPLE)


def _gone(pids: list[int], within_s: float = 15.0) -> None:
    alive = wait_gone(pids, within_s)
    assert not alive, f"workers outlived their stopped pool: {alive}"


class _Stopper:
    """A progress callback that SIGSTOPs one worker at a given step, and SIGKILLs it at the end of the test."""

    def __init__(self, pid: int, at_step: int):
        self.pid, self.at_step, self.stopped_at = pid, at_step, None

    def __call__(self, step: int, total: int) -> None:
        if step == self.at_step and self.stopped_at is None:
            os.kill(self.pid, signal.SIGSTOP)
            self.stopped_at = time.monotonic()

    def release(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_stopped_rank_is_named_and_the_restarted_pool_samples_like_a_fresh_run(stuck_pool, tiny, reference):
    model = stuck_pool.call(P.LoadModel(tiny["t2v"])).handle
    old = stuck_pool.pids()
    stopper = _Stopper(old[1], at_step=2)
    try:
        with pytest.raises(WorkerError) as caught:
            stuck_pool.call(_request(model, reference, steps=400), progress=stopper)
        waited = time.monotonic() - stopper.stopped_at
    finally:
        stopper.release()
    error = caught.value
    assert (error.rank, error.error_type) == (1, "WorkerStuck"), str(error)
    assert "rank 1 stopped answering" in error.message and "during sample step" in error.message, error.message
    assert "worker_timeout" in error.message and "\n" not in error.message
    assert WORKER_TIMEOUT_S - 1.5 <= waited < REPORTED_WITHIN_S, f"reported after {waited:.1f} s"
    assert not stuck_pool.running
    _gone(old)

    again = stuck_pool.call(_request(model, reference, steps=2)).latents  # restarts and reloads the model
    assert not set(stuck_pool.pids()) & set(old)
    torch.testing.assert_close(again, reference["latents"], rtol=1e-5, atol=1e-5)


def test_cancel_during_a_hang_returns_within_seconds(patient_pool, tiny, reference):
    model = patient_pool.call(P.LoadModel(tiny["t2v"])).handle
    old = patient_pool.pids()
    stopper = _Stopper(old[1], at_step=2)
    try:
        with pytest.raises(Cancelled, match="rank 1 is not answering"):
            patient_pool.call(_request(model, reference, steps=400), progress=stopper,
                              should_cancel=lambda: stopper.stopped_at is not None)
        waited = time.monotonic() - stopper.stopped_at
    finally:
        stopper.release()
    assert waited < CANCEL_WITHIN_S, f"the cancel took {waited:.1f} s"
    _gone(old)
    torch.testing.assert_close(patient_pool.call(_request(model, reference, steps=2)).latents, reference["latents"],
                               rtol=1e-5, atol=1e-5)


def test_the_hosts_interrupt_during_a_model_load_stops_the_pool(patient_pool, tiny, tmp_path):
    """The host's interrupt (registered once, raising its own exception) reaches a load that cannot stop
    part-way: both ranks sit in a load that takes an hour (``hang_diagnostics.py``), alive and heartbeating."""

    class HostInterrupt(Exception):
        pass

    slow = tmp_path / "wanmesh-slow-load.safetensors"
    shutil.copy(tiny["t2v"], slow)  # a real model file: only the injected sleep makes its load slow
    patient_pool.health()
    old = patient_pool.pids()
    asked = time.monotonic() + 1.0

    def interrupt() -> bool:
        if time.monotonic() > asked:
            raise HostInterrupt("interrupted by the host")
        return False

    pool_module.set_interrupt_check(interrupt)
    try:
        with pytest.raises(HostInterrupt):
            patient_pool.call(P.LoadModel(str(slow)))
        waited = time.monotonic() - asked
    finally:
        pool_module.set_interrupt_check(None)
    assert waited < CANCEL_WITHIN_S, f"the interrupt took {waited:.1f} s"
    _gone(old)
    assert patient_pool.health().ranks[0]["rank"] == 0  # the next call starts a fresh pool


@pytest.mark.parametrize("start", ["cold worker template", "no worker template"])
def test_an_interrupt_during_pool_start_stops_the_starting_workers(start, tmp_path, monkeypatch):
    """The interrupt comes while the start imports the model code: in the worker template (started anew here;
    it goes on importing for the next pool, and is not a worker), or in each worker."""
    if start == "cold worker template":  # a template of its own (the module's pools keep theirs)
        monkeypatch.setattr(worker_template, "_TEMPLATE", None)
    else:
        monkeypatch.setenv("WANMESH_WORKER_TEMPLATE", "0")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    before = set(psutil.Process().children(recursive=True))
    asked = time.monotonic() + 0.5
    pool_module.set_interrupt_check(lambda: time.monotonic() > asked)
    try:
        with pytest.raises(Cancelled, match="starting the worker pool was cancelled"):
            _pool(60.0)
        waited = time.monotonic() - asked
    finally:
        pool_module.set_interrupt_check(None)
    assert waited < CANCEL_WITHIN_S
    started = set(psutil.Process().children(recursive=True)) - before
    templates = [p for p in started if "--template" in p.cmdline()]
    template_family = set(templates).union(*(t.children(recursive=True) for t in templates))  # its resource tracker
    if start == "cold worker template":
        worker_template._TEMPLATE.close()  # it forked no worker
    _gone([p.pid for p in started - template_family])
    assert not list(tmp_path.glob("wanmesh-pool-*")), "the cancelled start left its temp folder"
