"""The WanMesh Cache node on a real ComfyUI server (recent ComfyUI): into the WanMesh Sampler and into the WanMesh
Native Model under ComfyUI's KSampler, and into the WanMesh Stream Sampler (the stream_t2v workflow, Ulysses 2). All skip steps (the latents move away from the uncached run's, the log
counts the skipped steps), the two paths take the same decisions on the same model, seed and schedule (so their
latents agree), Ulysses on two ranks gives world 1's latents, and bad settings fail in one line."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, RejectedPrompt
from test_comfyui_server import run_successfully
from workflow_graph import load_workflow, node_of_type
from test_native_sampling import (MODEL_FILE, NATIVE_SHIFT, TEXT_ENCODER_FILE, largest_difference, pool_inputs,
                                  save_latent, saved)

STEPS, CFG, SEED, TOLERANCE = 6, 5.0, 11, 1e-4
CACHE = {"method": "teacache", "threshold": 0.5, "start_percent": 0.1, "end_percent": 1.0, "max_skips": 0,
         "coefficients": "auto"}
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2)}


def cache_prompt(layout: dict[str, Any], cache: dict[str, Any] = CACHE) -> dict[str, Any]:
    """The WanMesh Sampler (``s``) and KSampler on the WanMesh Native Model (``k``), each with (``...c``) and
    without the WanMesh Cache."""
    prompt: dict[str, Any] = {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": TEXT_ENCODER_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a red fox"}},
        "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}},
        "wm": {"class_type": "WanMeshModelLoader",
               "inputs": {"model_name": MODEL_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 48, "height": 48, "length": 1, "batch_size": 1}},
        "cache": {"class_type": "WanMeshCache", "inputs": cache},
    }
    for suffix, cached in (("", False), ("c", True)):
        extra = {"cache": ["cache", 0]} if cached else {}
        prompt[f"sampler{suffix}"] = {"class_type": "WanMeshSampler", "inputs": {
            "model": ["wm", 0], "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["latent", 0],
            "seed": SEED, "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT, "sampler_name": "euler",
            "denoise": 1.0, "scheduler": "simple", **extra}}
        prompt[f"s{suffix}"] = save_latent(f"sampler{suffix}", f"s{suffix}")
        prompt[f"native{suffix}"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0], **extra}}
        prompt[f"ksampler{suffix}"] = {"class_type": "KSampler", "inputs": {
            "model": [f"native{suffix}", 0], "positive": ["pos", 0], "negative": ["neg", 0],
            "latent_image": ["latent", 0], "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler_name": "euler",
            "scheduler": "simple", "denoise": 1.0}}
        prompt[f"k{suffix}"] = save_latent(f"ksampler{suffix}", f"k{suffix}")
    return prompt


@pytest.fixture(scope="module")
def latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(recent_comfyui_server, cache_prompt(layout))
        found[name] = {node: saved(recent_comfyui_server, result, node) for node in ("s", "sc", "k", "kc")}
    return found


def test_the_cache_skips_steps_in_both_paths(latents, recent_comfyui_server: ComfyUIServer):
    world1 = latents["world1"]
    assert largest_difference(world1["s"], world1["sc"]) > 100 * TOLERANCE
    assert largest_difference(world1["k"], world1["kc"]) > 100 * TOLERANCE
    reports = re.findall(r"step cache teacache: (\d+) steps computed, (\d+) skipped", recent_comfyui_server.log())
    assert reports and all(int(skipped) >= 1 and int(done) + int(skipped) == STEPS for done, skipped in reports)
    # the tiny model has no published numbers: the node's log names the fallback
    assert "transformer calls; the generic rule (no published numbers for this model)" in recent_comfyui_server.log()


def test_sampler_and_native_model_take_the_same_decisions(latents):
    """The same model, seed and euler schedule: the uncached paths agree (as native parity shows), and so do the
    cached ones (the same steps skipped)."""
    world1 = latents["world1"]
    assert largest_difference(world1["s"], world1["k"]) <= TOLERANCE
    assert largest_difference(world1["sc"], world1["kc"]) <= TOLERANCE


def test_ulysses_gives_world_one_latents_with_the_cache(latents):
    for node in ("sc", "kc"):
        assert largest_difference(latents["ulysses2"][node], latents["world1"][node]) <= TOLERANCE, node


def test_bad_cache_settings_fail_in_one_line(recent_comfyui_server: ComfyUIServer):
    prompt = cache_prompt(LAYOUTS["world1"], {**CACHE, "start_percent": 0.8, "end_percent": 0.2})
    result = recent_comfyui_server.run(prompt, 300)
    text = result.error_text()
    assert isinstance(result, RejectedPrompt) or result.status != "success"
    assert "cache start_percent 0.8 is after end_percent 0.2" in text


def test_the_stream_sampler_caches_within_each_chunk(recent_comfyui_server: ComfyUIServer):
    """The example stream workflow (Ulysses 2; 5 latent frames in chunks of 2, 4 steps each) with the cache: its
    log counts every chunk's steps, at least one skipped (world 1's equality: tests/distributed)."""
    prompt = load_workflow("api/stream_t2v.json")
    node_of_type(prompt, "WanMeshStreamSampler")["inputs"]["cache"] = ["cache", 0]
    prompt["cache"] = {"class_type": "WanMeshCache", "inputs": {**CACHE, "threshold": 2.0}}
    run_successfully(recent_comfyui_server, prompt)
    reports = re.findall(r"WanMesh Stream Sampler: step cache teacache: (\d+) steps computed, (\d+) skipped",
                         recent_comfyui_server.log())
    assert len(reports) == 1, recent_comfyui_server.log()[-3000:]
    computed, skipped = map(int, reports[0])
    assert skipped >= 1 and computed + skipped == 3 * 4
