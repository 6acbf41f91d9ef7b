"""GGUF through the worker pool: tp=2 sampling from the tiny Q8_0 file equals one rank (each rank reads and
dequantises only its slices), and a tp=2 cut that splits Q4_K blocks fails with its one-line error, after which
the pool still serves."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import WorkerPool
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.models.tiny import TINY_TRANSFORMER, make_tiny
from wanmesh.parallel.models.wan import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("gguf_tiny"))


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")


def _request() -> SampleRequest:
    generator = torch.Generator().manual_seed(7)
    text_dim = TINY_TRANSFORMER["text_dim"]
    return SampleRequest(
        handle="", latent=torch.zeros(1, 16, 2, 8, 8), positive=[torch.randn(9, text_dim, generator=generator)],
        negative=[torch.randn(4, text_dim, generator=generator)], seed=3, steps=4, guidance_scale=5.0, shift=3.0)


def _sample(runner: PoolRunner, path: str) -> torch.Tensor:
    handle = runner.load_model(path)
    try:
        return runner.sample(replace(_request(), handle=handle))
    finally:
        runner.unload(handle)


def test_tp2_on_the_q8_0_file_equals_one_rank(models):
    path = str(models["t2v_gguf_q8_0"])
    with torch.no_grad():  # one device: the ordinary loader and the same sampling loop, in this process
        single = sample(load_transformer(path), _request())
    with WorkerPool(ParallelConfig(world=2, tp=2, devices="cpu"), timeout_s=300) as pool:
        runner = PoolRunner(pool)
        sharded = _sample(runner, path)
        with pytest.raises(Exception, match=r"ffn.2.weight of shape \(128, 256\) and type Q4_K .*\(tp=2\)"):
            runner.load_model(str(models["t2v_gguf_q4_k"]))
        again = _sample(runner, path)
    assert single.std() > 0.1
    assert (sharded - single).abs().max() <= TOLERANCE, f"max |tp2 - one rank| = {(sharded - single).abs().max():.3g}"
    assert torch.equal(again, sharded), "the pool must serve unchanged after the refused load"
