"""ComfyUI's "unload models" (``/free`` with ``unload_models``: ``unload_pool_models``) gives the workers' memory
back: after each of a few rounds of loading a model, encoding, sampling and decoding on a 2-rank pool, every
worker's resident size (RSS) returns to within FREED_WITHIN_MIB of its size right after the pool started.

A worker imports diffusers and the model modules on its first model request and keeps them (about 200 MiB that
no unload gives back), so the unload lets the workers exit and the next request starts fresh ones: right after
the unload no worker of the pool is left, and the fresh workers measure within the bound of the first start. The
model file is made wide (MODEL_MIB) so that weights kept anywhere would show far above the bound; the models
load again in the fresh workers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest
import torch

from pool_helpers import traceback_deadline
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import ParallelConfig, latent_shape
from wanmesh.parallel.driver.pool import close_cached_pool, get_pool
from wanmesh.parallel.pool_memory import unload_pool_models

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from wide_models import MIB, wide_ffn_dim, write_wide_t2v  # noqa: E402

DEADLINE_S = 300
DIAGNOSTICS = str(Path(__file__).with_name("memory_diagnostics.py"))
MODEL_MIB = 96
ROUNDS = 3
FREED_WITHIN_MIB = 64


def _rss_mib(pids: list[int]) -> list[float]:
    return [psutil.Process(pid).memory_info().rss / MIB for pid in pids]


def _one_round(pool, files: dict[str, str], seed: int) -> None:
    """What a t2v prompt asks of the pool: load, encode, sample, decode."""
    model = pool.call(P.LoadModel(files["model"])).handle
    vae = pool.call(P.LoadVae(files["vae"])).handle
    text = pool.call(P.LoadTextEncoder(files["text_encoder"])).handle
    embeddings = pool.call(P.EncodeText(handle=text, prompts=["a fox"])).embeddings
    request = P.SampleRequest(model, torch.zeros(latent_shape(32, 32, 5)), embeddings, embeddings, seed=seed,
                              steps=2, guidance_scale=1.0, shift=3.0, sampler="euler")
    pool.call(P.Decode(handle=vae, latents=pool.call(request).latents))


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory) -> dict[str, str]:
    wide = tmp_path_factory.mktemp("wide") / "wan_wide_t2v.safetensors"
    write_wide_t2v(wide, seed=7, ffn_dim=wide_ffn_dim(MODEL_MIB))
    return {"model": str(wide), "vae": str(tiny_models["vae"]), "text_encoder": str(tiny_models["text_encoder"])}


def test_unload_models_returns_every_workers_memory(files, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    with traceback_deadline(DEADLINE_S):
        pool = get_pool(ParallelConfig(world=2, devices="cpu"), diagnostics=DIAGNOSTICS)
        try:
            started = _rss_mib(pool.pids())
            rounds = []
            for seed in range(ROUNDS):
                _one_round(pool, files, seed)
                old = pool.pids()
                loaded = _rss_mib(old)
                assert unload_pool_models()
                assert pool.pids() == [] and not any(psutil.pid_exists(pid) and psutil.Process(pid).status()
                                                     != psutil.STATUS_ZOMBIE for pid in old), "workers outlived it"
                pool.call(P.Health())  # the next request starts fresh workers
                rounds.append((loaded, _rss_mib(pool.pids())))
        finally:
            close_cached_pool()
    report = (f"RSS per worker (MiB): started {_fmt(started)}; "
              + "; ".join(f"round {i}: loaded {_fmt(loaded)} -> unloaded, fresh workers {_fmt(freed)}"
                          for i, (loaded, freed) in enumerate(rounds)))
    print("\n" + report)
    for loaded, freed in rounds:
        assert len(freed) == len(started) and all(f - s <= FREED_WITHIN_MIB for f, s in zip(freed, started)), report
        assert all(l - s > MODEL_MIB for l, s in zip(loaded, started)), f"the model did not show: {report}"


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)
