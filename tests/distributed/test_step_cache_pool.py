"""Step caching on every layout: tensor, Ulysses, ring and CFG parallel take the same skip decisions as one device
and give its latents (tiny models, world 2 on CPU ranks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pool_helpers import cpu_pool, embed_prompts, tiny_models_within
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.cache_settings import CacheSettings, cache_fields
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
SAMPLE = dict(seed=5, steps=6, guidance_scale=4.0, shift=3.0)
# thresholds that skip steps on the tiny random model; 9 tokens: the sequence ranks pad the last slice
RUNS = {
    "teacache": (CacheSettings("teacache", 0.5, start_percent=0.1), "unipc"),
    "magcache": (CacheSettings("magcache", 0.2, start_percent=0.1), "euler"),
    "fbcache": (CacheSettings("fbcache", 1.0, start_percent=0.1), "unipc"),
}
LAYOUTS = {"tp2": dict(tp=2), "ulysses2": dict(ulysses=2), "ring2": dict(ring=2), "cfg2": dict(cfg_parallel=True)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _request(model, positive, negative, method: str) -> P.SampleRequest:
    settings, sampler = RUNS[method]
    return P.SampleRequest(model, torch.zeros(latent_shape(48, 48, 1)), positive, negative, sampler=sampler,
                           cache=cache_fields(settings), **SAMPLE)


@pytest.fixture(scope="module")
def reference(tiny):
    engine = RankExecutor("cpu")
    positive, negative = embed_prompts(engine, tiny["text_encoder"], "a cat", "")
    model = engine.load_model(tiny["t2v"])
    replies = {method: engine.sample_latents(_request(model, positive, negative, method)) for method in RUNS}
    uncached = engine.sample_latents(P.SampleRequest(model, torch.zeros(latent_shape(48, 48, 1)), positive,
                                                     negative, **SAMPLE))
    return {"positive": positive, "negative": negative, "replies": replies, "uncached": uncached.latents}


def test_world_one_skips_steps(reference):
    for method, reply in reference["replies"].items():
        report = reply.cache_report
        assert report["skipped"] >= 1, (method, report)
        assert report["computed"] + report["skipped"] == SAMPLE["steps"]
        assert report["calls"] == 2 * report["computed"]  # both guidance passes skip together
    assert not torch.equal(reference["replies"]["teacache"].latents, reference["uncached"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_takes_world_one_decisions(tiny, reference, layout, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    with cpu_pool(world=2, **LAYOUTS[layout]) as pool:
        model = pool.call(P.LoadModel(tiny["t2v"])).handle
        for method, expected in reference["replies"].items():
            reply = pool.call(_request(model, reference["positive"], reference["negative"], method))
            # every rank checks the others' decisions (check_same_decisions) before answering
            assert reply.cache_report["skipped_steps"] == expected.cache_report["skipped_steps"], (layout, method)
            assert reply.cache_report["computed"] == expected.cache_report["computed"]
            torch.testing.assert_close(reply.latents, expected.latents, rtol=1e-4, atol=1e-4)


def test_data_parallel_with_fewer_rows_than_replicas_decides_as_world_one(tiny, reference, monkeypatch):
    """dp 3 with 2 rows: the two replicas holding a row sum their statistics (the third holds none and samples
    nothing), so they take world 1's decisions on the whole batch and give its latents. The rows start from
    unlike latents (noise, and zeros), so a decision from one row alone would differ."""
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    start = torch.randn(latent_shape(48, 48, 1), generator=torch.Generator().manual_seed(4))
    latent = torch.cat([start, torch.zeros_like(start)])
    engine = RankExecutor("cpu")
    model = engine.load_model(tiny["t2v"])
    requests = {method: P.SampleRequest("", latent, reference["positive"], reference["negative"], sampler=sampler,
                                        cache=cache_fields(settings), add_noise=False, **SAMPLE)
                for method, (settings, sampler) in RUNS.items()}
    expected = {method: engine.sample_latents(replace(request, handle=model)) for method, request in requests.items()}
    with cpu_pool(world=3) as pool:
        handle = pool.call(P.LoadModel(tiny["t2v"])).handle
        for method, request in requests.items():
            reply = pool.call(replace(request, handle=handle))  # the ranks check their decisions agree
            assert reply.cache_report["skipped_steps"] == expected[method].cache_report["skipped_steps"], method
            torch.testing.assert_close(reply.latents, expected[method].latents, rtol=1e-4, atol=1e-4)
