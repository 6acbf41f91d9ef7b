"""Resident models stay within the per-rank memory budget: switching among three model files on a real 2-rank
gloo pool unloads the least recently used ones (on every rank), and a handle whose model was unloaded still
samples, giving the same latents as before."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pool_helpers import embed_prompts, traceback_deadline
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import ParallelConfig, latent_shape
from wanmesh.parallel.driver.pool import WorkerPool

DEADLINE_S = 300
DIAGNOSTICS = str(Path(__file__).with_name("memory_diagnostics.py"))
SAMPLE = dict(seed=3, steps=1, guidance_scale=1.0, shift=3.0, sampler="euler")


@pytest.fixture(scope="module")
def three_models(tiny_models, tmp_path_factory) -> list[str]:
    """Three distinct model files (copies of the tiny T2V model under different names: different handles)."""
    folder = tmp_path_factory.mktemp("three")
    paths = []
    for name in ("first", "second", "third"):
        paths.append(str(shutil.copy(tiny_models["t2v"], folder / f"wan_{name}.safetensors")))
    return paths


@pytest.fixture(scope="module")
def embeddings(tiny_models):
    from wanmesh.parallel.worker.executors import RankExecutor

    with traceback_deadline(DEADLINE_S):
        yield tuple(embed_prompts(RankExecutor("cpu"), str(tiny_models["text_encoder"]), "a cat", ""))



def _sample(pool, handle, embeddings) -> torch.Tensor:
    request = P.SampleRequest(handle, torch.zeros(latent_shape(32, 32, 5)), embeddings[0], embeddings[1], **SAMPLE)
    return pool.call(request).latents


def test_switching_models_keeps_each_rank_within_its_budget(three_models, embeddings, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    model_bytes = Path(three_models[0]).stat().st_size
    budget_gb = 1.5 * model_bytes / 1e9  # one model fits, two do not
    config = ParallelConfig(world=2, devices="cpu", memory_budget_gb=budget_gb)
    with WorkerPool(config, timeout_s=240, diagnostics=DIAGNOSTICS) as pool:
        handles, first_latents = [], {}
        for round_ in range(2):
            for path in three_models:
                handle = pool.call(P.LoadModel(path)).handle
                latents = _sample(pool, handle, embeddings)
                if round_ == 0:
                    handles.append(handle)
                    first_latents[handle] = latents
                else:  # loaded again after being unloaded by the budget: the same model, the same result
                    torch.testing.assert_close(latents, first_latents[handle], rtol=0, atol=0)
                for rank in pool.health().ranks:
                    assert rank["loaded"] == [handle], f"rank {rank['rank']} holds {rank['loaded']}"
                info = pool.call(P.Diagnostic("residency")).info
                assert 0 < info["bytes"] <= info["budget"] == int(budget_gb * 1e9)
        assert pool.call(P.Diagnostic("residency")).info["evictions"] == (handles * 2)[:5]
        # A handle unloaded by the budget still samples: the rank loads it again (and unloads the other).
        torch.testing.assert_close(_sample(pool, handles[0], embeddings), first_latents[handles[0]], rtol=0, atol=0)
        assert [r["loaded"] for r in pool.health().ranks] == [[handles[0]], [handles[0]]]

