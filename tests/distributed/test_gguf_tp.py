"""GGUF through the worker pool: tp=2 sampling from the tiny Q8_0 and Q4_K files, with their weights kept
quantized on each rank, equals one rank (each rank reads only its slices; the Q4_K tensor whose tp=2 slice
would cut its quant blocks is dequantized at load on each rank), and with weights dequantized at load too."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pool_helpers import cpu_pool, one_thread_per_worker, random_prompt_request, tiny_model_paths  # noqa: F401
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model_paths(tmp_path_factory.mktemp("gguf_tiny"))


def _request() -> SampleRequest:
    return random_prompt_request(torch.zeros(1, 16, 2, 8, 8), torch.Generator().manual_seed(7), seed=3, steps=4,
                                 guidance_scale=5.0, shift=3.0)


def _sample(runner: PoolRunner, path: str, weights: str = "keep") -> torch.Tensor:
    handle = runner.load_model(path, weights=weights)
    try:
        return runner.sample(replace(_request(), handle=handle))
    finally:
        runner.unload(handle)


def test_tp2_on_gguf_files_equals_one_rank(models):
    paths = [str(models[key]) for key in ("t2v_gguf_q8_0", "t2v_gguf_q4_k")]
    with torch.no_grad():  # one device: the ordinary loader and the same sampling loop, in this process
        singles = [sample(load_transformer(path), _request()) for path in paths]
    with cpu_pool(world=2, tp=2) as pool:
        runner = PoolRunner(pool)
        sharded = [_sample(runner, path, weights) for path in paths for weights in ("keep", "dequantize")]
    for single, kept, expanded in zip(singles, sharded[::2], sharded[1::2]):
        assert single.std() > 0.1
        assert (kept - single).abs().max() <= TOLERANCE, f"max |tp2 - one rank| = {(kept - single).abs().max():.3g}"
        assert (expanded - single).abs().max() <= TOLERANCE
