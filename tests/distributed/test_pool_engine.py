"""The pool serving the real engine on tiny models: world 2 gives what one in-process Engine gives,
models stay resident between requests, and a restarted pool reloads them under the same handles."""

from __future__ import annotations


import os
import signal

import pytest
import torch

from pool_helpers import cpu_pool, embed_prompts, tiny_models_within
from wanmesh.parallel import protocol as P
from wanmesh.parallel.worker.executors import RankExecutor
from wanmesh.parallel.driver.pool import WorkerError
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.config import latent_shape

DEADLINE_S = 400
SAMPLE = dict(seed=7, steps=2, guidance_scale=4.0, shift=3.0, sampler="unipc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


@pytest.fixture(scope="module")
def reference(tiny):
    """One Engine in this process, the same requests."""
    engine = RankExecutor("cpu")
    positive, negative = embed_prompts(engine, tiny["text_encoder"], "a cat", "")
    model = engine.load_model(tiny["t2v"])
    latent = torch.zeros(latent_shape(32, 32, 5))
    latents = engine.sample(SampleRequest(handle=model, latent=latent, positive=positive, negative=negative, **SAMPLE))
    frames = engine.decode(engine.load_vae(tiny["vae"]), latents)
    return {"positive": positive, "negative": negative, "latents": latents, "frames": frames}


def test_world_two_serves_the_engine_like_one_engine(tiny, reference, monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    close = dict(rtol=1e-5, atol=1e-5)
    with cpu_pool(world=2) as pool:
        text = pool.call(P.LoadTextEncoder(tiny["text_encoder"])).handle
        positive = pool.call(P.EncodeText(text, ["a cat"])).embeddings
        negative = pool.call(P.EncodeText(text, [""])).embeddings
        torch.testing.assert_close(positive, reference["positive"], **close)
        model = pool.call(P.LoadModel(tiny["t2v"])).handle
        assert pool.call(P.LoadModel(tiny["t2v"])).handle == model  # resident: same key, no second copy

        steps = []
        request = P.SampleRequest(model, torch.zeros(latent_shape(32, 32, 5)), positive, negative, **SAMPLE)
        latents = pool.call(request, progress=lambda s, n: steps.append((s, n))).latents
        assert steps == [(1, 2), (2, 2)]
        torch.testing.assert_close(latents, reference["latents"], **close)
        vae = pool.call(P.LoadVae(tiny["vae"])).handle
        frames = pool.call(P.Decode(vae, latents)).images
        torch.testing.assert_close(frames, reference["frames"], **close)
        for rank in pool.health().ranks:
            assert set(rank["loaded"]) == {text, model, vae}

        with pytest.raises(WorkerError, match=r"rank \d: KeyError: .*no vae is loaded under 'vae\|nope'"):
            pool.call(P.Decode("vae|nope", latents))

        os.kill(pool.pids()[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match="WorkerDied"):
            pool.health()
        again = pool.call(request).latents  # fresh pool: the model is reloaded under the same handle
        torch.testing.assert_close(again, reference["latents"], **close)
        assert pool.starts == 2
        assert {h for r in pool.health().ranks for h in r["loaded"]} == {model}

        pool.call(P.Unload())
        assert all(r["loaded"] == [] for r in pool.health().ranks)


def test_a_request_to_a_rank_killed_between_calls_names_the_rank(monkeypatch):
    """A rank killed between calls, before the pool's liveness check has seen it (the check is held off here): the
    next request finds the rank's pipe closed when it is sent, and the call raises WorkerDied naming the rank, not
    the pipe's BrokenPipeError; the call after starts a fresh pool."""
    with cpu_pool(world=2) as pool:
        pool.health()
        backend = pool._backend
        monkeypatch.setattr(backend, "check_alive", lambda: None)
        os.kill(pool.pids()[1], signal.SIGKILL)
        backend.procs[1].wait(timeout=30)
        with pytest.raises(WorkerError, match="WorkerDied") as died:
            pool.health()
        assert died.value.rank == 1, died.value
        assert len(pool.health().ranks) == 2
