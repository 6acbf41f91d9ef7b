"""Two experts in a real worker pool: a two-expert run with tensor parallelism over 2 gloo ranks equals one
rank, each expert stays resident and sharded (tp 2 holds about half of each expert's parameter bytes per
rank), a sample reloads nothing, and two experts of different kinds fail before any step runs."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from pool_helpers import cpu_pool, one_thread_per_worker, random_prompt_request, tiny_model_paths  # noqa: F401
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.errors import WorkerError
from wanmesh.parallel.protocol import Diagnostic, SampleRequest

DIAGNOSTICS = str(Path(__file__).with_name("resident_memory_diagnostics.py"))
TOLERANCE = 1e-4
STEPS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tiny_model_paths(tmp_path_factory.mktemp("experts_tiny"))


def _request() -> SampleRequest:
    return random_prompt_request(torch.zeros(latent_shape(64, 48, 5)), torch.Generator().manual_seed(4), (8, 5),
                                 seed=21, steps=STEPS, guidance_scale=4.0, shift=3.0, sampler="unipc",
                                 boundary=0.875, guidance_scale_low=3.0)


def _run_pool(layout: dict, models) -> dict:
    """Load both experts, sample once, and collect replies and per-rank memory before and after the sample."""
    with cpu_pool(diagnostics=DIAGNOSTICS, **layout) as pool:
        runner = PoolRunner(pool)
        high = runner.load_model(str(models["t2v"]))
        low = runner.load_model(str(models["t2v_low"]))
        before = pool.call(Diagnostic(op="resident_memory")).info["ranks"]
        request = replace(_request(), handle=high, handle_low=low)
        reply = runner.sample_reply(request)
        after = pool.call(Diagnostic(op="resident_memory")).info["ranks"]
        vace = runner.load_model(str(models["vace"]))
        with pytest.raises(WorkerError, match="experts differ in vace_layers") as refused:
            runner.sample(replace(request, handle_low=vace),
                          progress=lambda step, total: pytest.fail("a step ran before the experts were checked"))
        return {"reply": reply, "before": before, "after": after, "handles": (high, low), "refused": refused}


@pytest.fixture(scope="module")
def runs(models):
    return {
        "single": _run_pool(dict(world=1), models),
        "tp2": _run_pool(dict(world=2, tp=2), models),
    }


def test_tp2_two_expert_run_equals_one_rank(runs):
    single, tp2 = runs["single"]["reply"], runs["tp2"]["reply"]
    assert single.latents.std() > 0.1
    assert (tp2.latents - single.latents).abs().max() <= TOLERANCE
    assert tp2.expert_steps == single.expert_steps
    assert single.expert_steps.startswith("high-noise expert: steps 0-") and "low-noise expert" in single.expert_steps


def test_each_expert_is_sharded_and_a_sample_reloads_nothing(runs):
    single_models = runs["single"]["after"][0]["models"]
    for rank_memory in runs["tp2"]["after"]:
        for handle in runs["tp2"]["handles"]:
            sharded = rank_memory["models"][handle]["parameter_bytes"]
            whole = single_models[handle]["parameter_bytes"]
            # attention and FFN weights split in half; embeddings, norms and the head stay whole
            assert 0.5 * whole < sharded < 0.65 * whole, (handle, sharded, whole)
    for run in runs.values():
        for before, after in zip(run["before"], run["after"]):
            assert {h: m["id"] for h, m in before["models"].items()} == {h: m["id"] for h, m in after["models"].items()}


def test_experts_of_different_kinds_are_refused_on_the_pool(runs):
    for run in runs.values():
        error = run["refused"].value
        assert error.error_type == "ValueError" and "\n" not in error.message
        assert "vace_layers None vs [0, 2]" in error.message
