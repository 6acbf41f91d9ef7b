"""Streaming through a real 2-rank pool (Ulysses 2): chunks reach the driver in order while the run goes on,
each chunk is the matching slice of the final result, the joined chunk frames equal one whole VAE decode, the
pool's result equals one device's, a cancel between steps keeps the chunks already delivered, and prompts posted
while the stream runs (one before it starts, one when chunk 0 arrives) switch it at the chunks they report, as
scheduled switches at those chunks do on one device (on Ulysses 2 and on tensor parallel 2)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from pool_helpers import cpu_pool, embed_prompts, tiny_models_within
from wanmesh.parallel.config import latent_shape, stream_chunks
from wanmesh.parallel.driver.live_prompts import LivePrompts, StreamEnded
from wanmesh.parallel.driver import local as local_backend
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.errors import Cancelled
from wanmesh.parallel.protocol import StreamSample
from wanmesh.parallel.transport import SHM_DIR, segment_names, take_handed_over
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 500
SHAPE = latent_shape(32, 32, 17)  # 5 latent frames: chunks of 2 run as 2 + 2 + 1
CHUNK, STEPS = 2, 2
CLOSE = dict(rtol=1e-4, atol=1e-4)
CANCELLED_STEPS = 6  # the steps after chunk 0 leave the driver time to ask for the stop before the run ends


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _request(model: str, vae: str | None, positive, seed: int = 11) -> StreamSample:
    return StreamSample(handle=model, latent=torch.zeros(SHAPE), positive=positive, negative=[], seed=seed,
                        steps=STEPS, shift=5.0, chunk=CHUNK, vae_handle=vae)


@pytest.fixture(scope="module")
def reference(tiny):
    """One device in this process: the streamed result and a whole (non-streamed) decode of its latents."""
    engine = RankExecutor("cpu")
    [positive] = embed_prompts(engine, tiny["text_encoder"], "a cat")
    model, vae = engine.load_model(tiny["t2v"]), engine.load_vae(tiny["vae"])
    latents, frames = engine.stream(_request(model, vae, positive))
    return {"positive": positive, "latents": latents, "frames": frames, "whole_decode": engine.decode(vae, latents)}


def test_one_device_streamed_frames_equal_the_whole_decode(reference):
    assert reference["frames"].shape == (17, 32, 32, 3)
    torch.testing.assert_close(reference["frames"], reference["whole_decode"], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def runner(tiny, reference):
    with cpu_pool(world=2, ulysses=2) as pool:
        runner = PoolRunner(pool)
        yield runner, runner.load_model(tiny["t2v"]), runner.load_vae(tiny["vae"])


def test_pool_streams_chunks_in_order_and_matches_one_device(runner, reference, monkeypatch):
    runner, model, vae = runner
    chunks, steps, handed_over = [], [], []

    def take_and_record(packed):  # the driver's side of each chunk's shared-memory segment
        handed_over.append(segment_names(packed))
        return take_handed_over(packed)

    monkeypatch.setattr(local_backend, "take_handed_over", take_and_record)

    def on_chunk(chunk):
        chunks.append((chunk, len(steps)))  # how many steps had been reported when the chunk arrived

    result = runner.stream(_request(model, vae, reference["positive"]), on_chunk=on_chunk,
                           progress=lambda s, n: steps.append((s, n)))
    plan = stream_chunks(SHAPE[2], CHUNK)
    assert [(c.index, c.start_frame, c.latents.shape[2]) for c, _ in chunks] == [
        (i, start, count) for i, (start, count) in enumerate(plan)]
    assert [seen for _, seen in chunks] == [STEPS * (i + 1) for i in range(len(plan))]  # sent as each chunk ends
    assert steps == [(s, STEPS * len(plan)) for s in range(1, STEPS * len(plan) + 1)]
    for chunk, _ in chunks:
        torch.testing.assert_close(chunk.latents, result.latents[:, :, chunk.start_frame: chunk.start_frame + chunk.latents.shape[2]])
        assert chunk.first_image_frame == (0 if chunk.start_frame == 0 else 4 * chunk.start_frame - 3)
    # Each chunk's latents and frames came in one segment of their own, unlinked once read.
    assert [len(names) for names in handed_over] == [1] * len(plan), handed_over
    assert not [name for names in handed_over for name in names if os.path.exists(os.path.join(SHM_DIR, name))]
    joined = torch.cat([c.frames for c, _ in chunks])
    torch.testing.assert_close(joined, result.frames)
    torch.testing.assert_close(result.latents, reference["latents"], **CLOSE)  # Ulysses 2 == one device
    torch.testing.assert_close(result.frames, reference["whole_decode"], **CLOSE)


def test_without_vae_chunks_carry_latents_only(runner, reference):
    runner, model, _ = runner
    chunks = []
    result = runner.stream(_request(model, None, reference["positive"]), on_chunk=chunks.append)
    assert result.frames is None and all(c.frames is None for c in chunks) and len(chunks) == 3
    torch.testing.assert_close(result.latents, reference["latents"], **CLOSE)


def test_cancel_between_steps_keeps_the_chunks_already_delivered(runner, reference):
    """The stop is asked for once chunk 0 arrives. The ranks see it at a step boundary, whose position depends
    on how fast the driver reads its messages, so the test checks what holds at every position: each chunk whose
    steps all ran reached the caller whole, and no other one did."""
    runner, model, vae = runner
    request = replace(_request(model, vae, reference["positive"], seed=12), steps=CANCELLED_STEPS)
    chunks, steps_done = [], []
    with pytest.raises(Cancelled):
        runner.stream(request, on_chunk=chunks.append, progress=lambda step, total: steps_done.append(step),
                      should_stop=lambda: len(chunks) >= 1)
    plan = stream_chunks(SHAPE[2], CHUNK)
    assert 1 <= len(chunks) < len(plan), "the stop reached the ranks before the run ended"
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert len(chunks) == max(steps_done) // CANCELLED_STEPS  # every finished chunk delivered, no partial one
    again = runner.stream(request)  # the pool stays usable, and the kept chunks are the whole run's
    for chunk in chunks:
        end = chunk.start_frame + chunk.latents.shape[2]
        torch.testing.assert_close(chunk.latents, again.latents[:, :, chunk.start_frame: end], rtol=0, atol=0)
        first = chunk.first_image_frame
        torch.testing.assert_close(chunk.frames, again.frames[first: first + chunk.frames.shape[0]], rtol=0, atol=0)
    assert chunks[0].frames.shape[0] == 4 * CHUNK - 3


def test_bad_requests_fail_in_the_driver(runner, reference):
    runner, model, vae = runner
    with pytest.raises(ValueError, match="kv_window=1 latent frames is smaller than a chunk of 2"):
        runner.stream(StreamSample(handle=model, latent=torch.zeros(SHAPE), positive=reference["positive"],
                                   negative=[], seed=0, chunk=CHUNK, kv_window=1))
    with pytest.raises(ValueError, match="timesteps must be a non-empty, strictly descending list"):
        runner.stream(StreamSample(handle=model, latent=torch.zeros(SHAPE), positive=reference["positive"],
                                   negative=[], seed=0, timesteps=[250.0, 500.0]))


@pytest.fixture(scope="module")
def tp_runner(tiny, reference):
    """Tensor parallel 2: the text encoder and the causal model sharded, so a posted prompt's encoding is a
    collective inside the chunk loop."""
    with cpu_pool(world=2, tp=2) as pool:
        runner = PoolRunner(pool)
        yield runner, runner.load_model(tiny["t2v"]), None


@pytest.mark.parametrize("layout", ["ulysses2", "tp2"])
def test_prompts_posted_while_streaming_switch_like_scheduled_switches(layout, request, reference, tiny):
    runner, model, _ = request.getfixturevalue("runner" if layout == "ulysses2" else "tp_runner")
    text_encoder = runner.load_text_encoder(tiny["text_encoder"])
    live = LivePrompts()
    posted = {"a dog on a beach": live.post("a dog on a beach")}  # before the stream starts: chunk 1

    def on_chunk(chunk):
        if chunk.index == 0:  # while the ranks work on chunk 1: the next free chunk, 2
            posted["a bird in the sky"] = live.post("a bird in the sky")

    request = replace(_request(model, None, reference["positive"], seed=13), steps=CANCELLED_STEPS,
                      live_text_encoder=text_encoder)
    result = runner.stream(request, on_chunk=on_chunk, live=live)
    chunks = {text: future.result(timeout=0) for text, future in posted.items()}
    assert chunks == {"a dog on a beach": 1, "a bird in the sky": 2}
    live.close("the stream ended")
    with pytest.raises(StreamEnded, match="the stream ended"):
        live.post("too late")

    engine = RankExecutor("cpu")
    embeddings = embed_prompts(engine, tiny["text_encoder"], *chunks)
    local = engine.load_model(tiny["t2v"])
    scheduled = replace(request, handle=local, live_text_encoder=None, switch_chunks=list(chunks.values()),
                        switch_positive=embeddings)
    expected, _ = engine.stream(scheduled)
    torch.testing.assert_close(result.latents, expected, **CLOSE)
    plain, _ = engine.stream(replace(scheduled, switch_chunks=[], switch_positive=[]))
    before = CHUNK  # latent frames of chunk 0, made before any switch
    torch.testing.assert_close(result.latents[:, :, :before], plain[:, :, :before], **CLOSE)
    assert (result.latents[:, :, before:] - plain[:, :, before:]).abs().max() > 1e-2, "the posted prompts changed nothing"
