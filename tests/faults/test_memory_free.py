"""ComfyUI's "unload models" (``/free`` with ``unload_models``: ``unload_pool_models``) gives the models' memory
back while the workers stay up: after each of a few rounds of loading a model, encoding, sampling and decoding on a
2-rank pool, every worker is still the same process, its resident size (RSS) dropped by about the model's weights,
and it comes back within FREED_WITHIN_MIB of its size after the first unload (nothing accumulates); the next
round loads the weights again in the same workers (no pool start).

A worker imports diffusers and the model modules on its first model request and keeps them (about 200 MiB that
no unload gives back; "free memory", ``stop_pool``, does): the gap to a freshly started worker is printed. The
model file is made wide (MODEL_MIB) so that weights kept anywhere would show far above the bound.
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
ROUNDS = 4
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
            started, pids, starts = _rss_mib(pool.pids()), pool.pids(), pool.starts
            rounds = []
            for seed in range(ROUNDS):
                _one_round(pool, files, seed)
                loaded = _rss_mib(pool.pids())
                assert unload_pool_models()
                assert pool.pids() == pids and pool.starts == starts, "unload models restarted the workers"
                rounds.append((loaded, _rss_mib(pool.pids())))
        finally:
            close_cached_pool()
    report = (f"RSS per worker (MiB): started {_fmt(started)}; "
              + "; ".join(f"round {i}: loaded {_fmt(loaded)} -> unloaded {_fmt(freed)}"
                          for i, (loaded, freed) in enumerate(rounds))
              + f"; after unload above a fresh worker (model code kept): "
                f"{_fmt([f - s for f, s in zip(rounds[-1][1], started)])}")
    print("\n" + report)
    first_unloaded = rounds[0][1]
    for loaded, freed in rounds:
        assert all(l - s > MODEL_MIB for l, s in zip(loaded, started)), f"the model did not show: {report}"
        assert all(l - f > MODEL_MIB * 0.9 for l, f in zip(loaded, freed)), f"the weights stayed: {report}"
        assert all(f - b <= FREED_WITHIN_MIB for f, b in zip(freed, first_unloaded)), f"memory accumulates: {report}"


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.0f}" for v in values)
