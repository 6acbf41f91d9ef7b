"""LoRAs on the mesh: merged on tp 2 (each rank its slice of every delta) and on ulysses 2, the sampled latents
equal the LoRAs merged on one device; 20 load / switch / remove rounds on a 2-rank pool keep the workers'
resident memory flat."""

from __future__ import annotations

from dataclasses import replace

import psutil
import pytest
import torch

from pool_helpers import cpu_pool, one_thread_per_worker, tiny_models_within  # noqa: F401
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 600
ROUNDS = 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _loras(tiny):
    """Every format at once, in order; the diff file brings bias deltas (column- and row-sharded layers)."""
    return [(tiny["lora_comfy"], 0.8), (tiny["lora_kohya"], -0.6), (tiny["lora_peft"], 0.5), (tiny["lora_diff"], 1.0)]


def _request(handle: str, loras) -> P.SampleRequest:
    embeddings = [torch.randn(6, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    return P.SampleRequest(handle, torch.zeros(latent_shape(32, 32, 5)), embeddings[:1], embeddings[1:], seed=5,
                           steps=3, guidance_scale=4.0, shift=3.0, model_loras={handle: loras})


@pytest.fixture(scope="module")
def one_device(tiny):
    engine = RankExecutor("cpu")
    handle = engine.load_model(tiny["t2v"])
    plain = engine.sample(_request(handle, []))
    with_loras = engine.sample(_request(handle, _loras(tiny)))
    assert (with_loras - plain).abs().max() > 1e-2, "the LoRAs must change the result"
    return with_loras


@pytest.fixture(scope="module")
def tp_pool(tiny):
    with cpu_pool(world=2, tp=2) as pool:
        yield pool, pool.call(P.LoadModel(tiny["t2v"])).handle


def test_loras_merged_with_tp2_equal_one_device(tiny, one_device, tp_pool):
    pool, handle = tp_pool
    latents = pool.call(_request(handle, _loras(tiny))).latents
    assert (latents - one_device).abs().max() <= 1e-4


def test_loras_merged_with_ulysses2_equal_one_device(tiny, one_device):
    with cpu_pool(world=2, ulysses=2) as pool:
        handle = pool.call(P.LoadModel(tiny["t2v"])).handle
        latents = pool.call(_request(handle, _loras(tiny))).latents
    assert (latents - one_device).abs().max() <= 1e-4


def _rss(pool) -> list[int]:
    return [psutil.Process(pid).memory_info().rss for pid in pool.pids()]


def test_load_switch_remove_twenty_times_keeps_worker_memory_flat(tiny, tp_pool):
    pool, handle = tp_pool
    comfy, kohya, diff = tiny["lora_comfy"], tiny["lora_kohya"], tiny["lora_diff"]
    rounds = [[(comfy, 1.0)], [(comfy, 1.0), (kohya, 0.5)], [(diff, 0.7)], []]  # load, add, switch, remove
    # One cheap step per request: what is measured is the merge and the restore before it.
    # wan_unipc: ComfyUI's uni_pc takes two steps at least (one step leaves its multistep update no history).
    request = replace(_request(handle, []), latent=torch.zeros(latent_shape(16, 16, 1)), steps=1, guidance_scale=1.0,
                      sampler="wan_unipc")
    plain = pool.call(request).latents
    for loras in rounds:  # warm-up: allocator pools and lazily imported modules settle
        pool.call(replace(request, model_loras={handle: loras}))
    before = _rss(pool)
    for _ in range(ROUNDS):
        for loras in rounds:
            pool.call(replace(request, model_loras={handle: loras}))
    after = _rss(pool)
    assert torch.equal(pool.call(request).latents, plain)  # after all the switching: the base model exactly
    growth = [a / b - 1 for a, b in zip(after, before)]
    print(f"worker RSS before {[b >> 20 for b in before]} MiB, after {ROUNDS} rounds {[a >> 20 for a in after]} MiB")
    assert max(growth) <= 0.05, f"worker memory grew by {[f'{g:.1%}' for g in growth]}"
