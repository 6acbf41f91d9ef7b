"""GGUF through the worker pool: tp=2 sampling from the tiny Q8_0 file equals one rank (each rank reads and
dequantises only its slices), and a tp=2 cut that splits Q4_K blocks fails with its one-line error, after which
the pool still serves."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pool_helpers import cpu_pool, one_thread_per_worker, random_prompt_request, tiny_model_paths  # noqa: F401
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.models.wan import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model_paths(tmp_path_factory.mktemp("gguf_tiny"))


def _request() -> SampleRequest:
    return random_prompt_request(torch.zeros(1, 16, 2, 8, 8), torch.Generator().manual_seed(7), seed=3, steps=4,
                                 guidance_scale=5.0, shift=3.0)


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
    with cpu_pool(world=2, tp=2) as pool:
        runner = PoolRunner(pool)
        sharded = _sample(runner, path)
        with pytest.raises(Exception, match=r"ffn.2.weight of shape \(128, 256\) and type Q4_K .*\(tp=2\)"):
            runner.load_model(str(models["t2v_gguf_q4_k"]))
        again = _sample(runner, path)
    assert single.std() > 0.1
    assert (sharded - single).abs().max() <= TOLERANCE, f"max |tp2 - one rank| = {(sharded - single).abs().max():.3g}"
    assert torch.equal(again, sharded), "the pool must serve unchanged after the refused load"
