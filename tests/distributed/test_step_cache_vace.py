"""Step caching on a VACE model: a skipped step skips the VACE blocks too (their computations counted on one
device, with one and with two VACE contexts), and tensor and Ulysses parallel take world 1's decisions and give
its latents (tiny VACE model, world 2 on CPU ranks)."""

from __future__ import annotations

import pytest
import torch

from pool_helpers import cpu_pool, embed_prompts, tiny_models_within
from vace_inputs import two_vace_contexts
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.cache_settings import CacheSettings, cache_fields
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
SHAPE = latent_shape(48, 48, 1)  # 9 tokens: the Ulysses ranks pad the last slice
SAMPLE = dict(seed=5, steps=6, guidance_scale=4.0, shift=3.0)
METHODS = {
    "teacache": (CacheSettings("teacache", 0.5, start_percent=0.1), "unipc"),
    "magcache": (CacheSettings("magcache", 0.2, start_percent=0.1), "euler"),
    "fbcache": (CacheSettings("fbcache", 1.0, start_percent=0.1), "unipc"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _request(model, prompts, method: str | None, contexts: dict) -> P.SampleRequest:
    settings, sampler = METHODS[method] if method else (None, "unipc")
    return P.SampleRequest(model, torch.zeros(SHAPE), *prompts, sampler=sampler, cache=cache_fields(settings),
                           **contexts, **SAMPLE)


def _counting(module) -> list[int]:
    """A counter of the computations of ``module`` (a forward hook on a submodule every block runs)."""
    count = [0]
    module.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.fixture(scope="module")
def world_one(tiny):
    engine = RankExecutor("cpu")
    prompts = embed_prompts(engine, tiny["text_encoder"], "a cat", "")
    handle = engine.load_model(tiny["vace"])
    model = engine._get(handle, "model")
    vace_count = [_counting(block.ffn) for block in model.vace_blocks]
    main_count = _counting(model.blocks[-1].ffn)
    generator = torch.Generator().manual_seed(2)
    contexts = {"one": {}, "two": two_vace_contexts(SHAPE, generator)}  # {}: the native default context
    runs = {}
    for name, given in contexts.items():
        for method in (None, *METHODS):
            before = [c[0] for c in vace_count], main_count[0]
            reply = engine.sample_latents(_request(handle, prompts, method, given))
            computed = [c[0] - b for c, b in zip(vace_count, before[0])], main_count[0] - before[1]
            runs[name, method] = reply, computed
    return {"prompts": prompts, "contexts": contexts, "runs": runs}


@pytest.mark.parametrize("contexts, per_call", [("one", 1), ("two", 2)])
def test_a_skipped_step_skips_the_vace_blocks(world_one, contexts, per_call):
    plain, (plain_vace, plain_main) = world_one["runs"][contexts, None]
    assert plain_main == 2 * SAMPLE["steps"] and plain_vace == [per_call * plain_main] * len(plain_vace)
    for method in METHODS:
        reply, (vace, main) = world_one["runs"][contexts, method]
        report = reply.cache_report
        assert report["skipped"] >= 1, (method, report)
        assert main == report["calls"] == 2 * report["computed"]  # the main blocks ran on computed calls only
        assert vace == [per_call * main] * len(vace), (method, vace, main)  # and so did the VACE blocks
        assert not torch.equal(reply.latents, plain.latents)


def test_the_vace_hints_reach_the_cached_steps(world_one):
    """The kept residual holds the hints: other contexts give other latents on the cached run too."""
    for method in METHODS:
        one, two = (world_one["runs"][name, method][0] for name in ("one", "two"))
        assert one.cache_report["skipped"] >= 1
        assert (one.latents - two.latents).abs().max() > 1e-3, method


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ulysses=2)], ids=["tp2", "ulysses2"])
def test_vace_layouts_take_world_one_decisions(tiny, world_one, layout, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    given = world_one["contexts"]["two"]
    with cpu_pool(world=2, **layout) as pool:
        handle = pool.call(P.LoadModel(tiny["vace"])).handle
        for method in METHODS:
            expected = world_one["runs"]["two", method][0]
            reply = pool.call(_request(handle, world_one["prompts"], method, given))
            assert reply.cache_report["skipped_steps"] == expected.cache_report["skipped_steps"], (layout, method)
            assert reply.cache_report["calls"] == expected.cache_report["calls"]
            torch.testing.assert_close(reply.latents, expected.latents, rtol=1e-4, atol=1e-4)
