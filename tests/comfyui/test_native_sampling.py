"""ComfyUI's own samplers on the WanMesh MODEL equal them on the same weights loaded natively (recent ComfyUI).

One API prompt per pool layout holds, for each sampler/scheduler pair the issue names, two KSamplers on the same
latent, seed and conditioning: one on native ``UNETLoader``'s model, one on ``WanMesh Native Model`` over
``WanMesh Model Loader``'s model of the same file (the tiny native twin, which ComfyUI's Wan loader reads). ComfyUI's
Wan code is the independent reference: world 1 must be within 1e-4 of it, and tp 2, ulysses 2, cfg_parallel 2 and
layout auto on two ranks equal world 1. Different samplers' latents differ far beyond the tolerance, so the comparison would catch a difference.
"""

from __future__ import annotations

import random
import re
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, PromptResult
from safetensors.torch import load_file
from test_comfyui_server import assert_video, run_successfully, saved_video
from test_progress_and_cancel import (INTERRUPT_DEADLINE_S, LONG_RUN_STEPS, is_interruption_of, progress_of,
                                      submit_with_events)
from workflow_graph import MAX_SEED, load_workflow, node_of_type, with_inputs

MODEL_FILE, VACE_FILE = "wan_native_t2v.safetensors", "wan_native_vace.safetensors"
TEXT_ENCODER_FILE = "umt5_native.safetensors"
SAMPLERS = (("euler", "simple"), ("uni_pc", "simple"), ("dpmpp_2m", "beta"), ("lcm", "sgm_uniform"),
            ("euler_ancestral", "normal"))
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "tp2": dict(devices="cpu:2", world=2, tp=2),
           "ulysses2": dict(devices="cpu:2", world=2, ulysses=2),
           "cfg_parallel2": dict(devices="cpu:2", world=2, cfg_parallel=True),
           "auto2": dict(devices="cpu:2", world=2, layout="auto")}
# The WanMesh Sampler with ComfyUI's names: the first six run in the workers, res_multistep and ddim_uniform
# (a scheduler the workers do not have) through ComfyUI's own code on the MODEL.
NODE_SAMPLERS = (("euler", "simple"), ("euler_ancestral", "normal"), ("dpmpp_2m", "beta"), ("lcm", "sgm_uniform"),
                 ("euler", "karras"), ("uni_pc", "simple"), ("res_multistep", "simple"), ("euler", "ddim_uniform"))
NATIVE_SHIFT = 8.0  # ComfyUI's Wan 2.1 model sampling shift (what KSampler uses without ModelSamplingSD3)
SEED, STEPS, CFG = 1234, 4, 5.0
TOLERANCE = 1e-4
WIDTH, HEIGHT, LENGTH = 48, 32, 5


def pool_inputs(layout: dict[str, Any]) -> dict[str, Any]:
    base = dict(devices="cpu:1", world=1, tp=1, ulysses=1, ring=1, cfg_parallel=False, vae_patch=1, backend="local",
                ray_address="", worker_timeout=60.0, previews=False, memory_budget_gb=0.0)
    return {**base, **layout}


def pool_and_prompts(layout: dict[str, Any]) -> dict[str, Any]:
    """The prompt nodes the image-to-video tests start from: a Pool of ``layout``, the native umT5 twin on it, and
    the positive ("a fox runs") and negative ("blurry") prompts as nodes ``pos`` and ``neg``."""
    text_encoder = {"text_encoder_name": "umt5_native.safetensors", "dtype": "fp32", "pool": ["pool", 0]}
    return {"pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
            "te": {"class_type": "WanMeshTextEncoderLoader", "inputs": text_encoder},
            "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a fox runs"}},
            "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}}}


def ksampler(model: list, positive: list, negative: list, latent: list, sampler: str, scheduler: str,
             seed: int) -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": model, "positive": positive, "negative": negative, "latent_image": latent, "seed": seed,
        "steps": STEPS, "cfg": CFG, "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0}}


def twin_prompt(layout: dict[str, Any], model_file: str = MODEL_FILE, pairs=SAMPLERS, seed: int = SEED,
                wanmesh_dtype: str = "fp32") -> dict[str, Any]:
    """Native and WanMesh KSamplers side by side; node ``n{i}`` / ``w{i}`` save the latents of pair i; the WanMesh
    Model Loader computes in ``wanmesh_dtype``."""
    prompt: dict[str, Any] = {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": TEXT_ENCODER_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a red fox in snow"}},
        "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}},
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": "default"}},
        "wm": {"class_type": "WanMeshModelLoader",
               "inputs": {"model_name": model_file, "dtype": wanmesh_dtype, "pool": ["pool", 0]}},
        "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}},
    }
    for index, (sampler, scheduler) in enumerate(pairs):
        for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0])):
            prompt[f"{side}k{index}"] = ksampler(model, ["pos", 0], ["neg", 0], ["latent", 0], sampler, scheduler, seed)
            prompt[f"{side}{index}"] = save_latent(f"{side}k{index}", f"{side}{index}")
    return prompt


def with_wanmesh_sampler(prompt: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """Adds, per NODE_SAMPLERS pair, native KSampler (``nn{i}``) and the WanMesh Sampler on the WanMesh model
    (``s{i}``), with the same seed, steps, cfg and shift."""
    prompt = dict(prompt)
    for index, (sampler, scheduler) in enumerate(NODE_SAMPLERS):
        prompt[f"nnk{index}"] = ksampler(["unet", 0], ["pos", 0], ["neg", 0], ["latent", 0], sampler, scheduler, seed)
        prompt[f"nn{index}"] = save_latent(f"nnk{index}", f"nn{index}")
        prompt[f"sk{index}"] = {"class_type": "WanMeshSampler", "inputs": {
            "model": ["wm", 0], "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["latent", 0],
            "seed": seed, "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT, "sampler_name": sampler, "denoise": 1.0,
            "scheduler": scheduler}}
        prompt[f"s{index}"] = save_latent(f"sk{index}", f"s{index}")
    return prompt


def save_latent(source: str, name: str) -> dict[str, Any]:
    return {"class_type": "SaveLatent", "inputs": {"samples": [source, 0], "filename_prefix": f"native_sampling/{name}"}}


def with_custom_sampling(prompt: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """Adds SamplerCustomAdvanced with RandomNoise, CFGGuider, KSamplerSelect (dpmpp_2m) and BasicScheduler
    (karras) on each side; ``nc`` / ``wc`` save the native and WanMesh latents."""
    prompt = {**prompt, "noise": {"class_type": "RandomNoise", "inputs": {"noise_seed": seed}},
              "select": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "dpmpp_2m"}}}
    for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0])):
        prompt[f"{side}guider"] = {"class_type": "CFGGuider", "inputs": {
            "model": model, "positive": ["pos", 0], "negative": ["neg", 0], "cfg": CFG}}
        prompt[f"{side}sigmas"] = {"class_type": "BasicScheduler", "inputs": {
            "model": model, "scheduler": "karras", "steps": STEPS, "denoise": 1.0}}
        prompt[f"{side}custom"] = {"class_type": "SamplerCustomAdvanced", "inputs": {
            "noise": ["noise", 0], "guider": [f"{side}guider", 0], "sampler": ["select", 0],
            "sigmas": [f"{side}sigmas", 0], "latent_image": ["latent", 0]}}
        prompt[f"{side}c"] = save_latent(f"{side}custom", f"{side}c")
    return prompt


def saved(server: ComfyUIServer, result: PromptResult, node_id: str) -> torch.Tensor:
    (item,) = result.outputs[node_id]["latents"]
    return load_file(str(server.output_dir / item["subfolder"] / item["filename"]))["latent_tensor"].float()


def largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    """Every layout's latents: {layout: {"n0": native pair 0, "w0": WanMesh pair 0, ...}}."""
    latents = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(recent_comfyui_server, with_wanmesh_sampler(with_custom_sampling(twin_prompt(layout))))
        nodes = [f"{side}{i}" for side in "nw" for i in range(len(SAMPLERS))] + ["nc", "wc"]
        nodes += [f"{side}{i}" for side in ("nn", "s") for i in range(len(NODE_SAMPLERS))]
        latents[name] = {node: saved(recent_comfyui_server, result, node) for node in nodes}
    return latents


@pytest.mark.parametrize("pair", range(len(SAMPLERS)), ids=[f"{s}-{k}" for s, k in SAMPLERS])
def test_native_ksampler_on_wanmesh_model_equals_native_model(layout_latents, pair: int) -> None:
    native, wanmesh = layout_latents["world1"][f"n{pair}"], layout_latents["world1"][f"w{pair}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{SAMPLERS[pair]}: WanMesh MODEL is {difference:.3g} from the native model"


def test_sampler_custom_advanced_with_a_guider_on_wanmesh_model_equals_native_model(layout_latents) -> None:
    difference = largest_difference(layout_latents["world1"]["nc"], layout_latents["world1"]["wc"])
    assert difference <= TOLERANCE, f"SamplerCustomAdvanced: WanMesh MODEL is {difference:.3g} from the native model"


@pytest.mark.parametrize("pair", range(len(NODE_SAMPLERS)), ids=[f"{s}-{k}" for s, k in NODE_SAMPLERS])
def test_wanmesh_sampler_with_comfyui_names_equals_native_ksampler(layout_latents, pair: int) -> None:
    native, wanmesh = layout_latents["world1"][f"nn{pair}"], layout_latents["world1"][f"s{pair}"]
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"WanMesh Sampler {NODE_SAMPLERS[pair]} is {difference:.3g} from native KSampler"


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "world1"])
def test_parallel_layouts_equal_one_rank(layout_latents, layout: str) -> None:
    for node in (*(f"w{pair}" for pair in range(len(SAMPLERS))), "wc", *(f"s{i}" for i in range(len(NODE_SAMPLERS)))):
        difference = largest_difference(layout_latents[layout][node], layout_latents["world1"][node])
        assert difference <= TOLERANCE, f"{layout} {node}: {difference:.3g} from world 1"


def test_native_samplers_on_layout_auto_choose_the_layout_once_per_size(recent_comfyui_server: ComfyUIServer,
                                                                         layout_latents) -> None:
    """ComfyUI's samplers on a pool of layout auto: the first model call of the job chooses the layout (logged as
    the cost model's table, guidance read from the conditional and unconditional rows, steps from the sigmas);
    the other calls of that size on that pool keep it: one table for the prompt's KSamplers, SamplerCustomAdvanced
    and the WanMesh Sampler's runs through ComfyUI's code, not one per call. The latents equal one rank's (``test_parallel_layouts_equal_one_rank``)."""
    log = recent_comfyui_server.log()
    tables = re.findall(rf"WanMesh Native Model: auto layout \({WIDTH}x{HEIGHT}, {LENGTH} frames, (\d+) steps\)", log)
    assert tables, f"no auto layout table from a native sampler's model call in the log:\n{log[-3000:]}"
    assert tables == [str(STEPS)], f"{len(tables)} tables (steps {tables}): the layout was chosen more than once"


BF16_BAR, BF16_LAYOUT_BAR = 0.05, 0.03  # relative errors: bf16 against native fp32; tp 2 against world 1 in bf16
BF16_PAIRS = (("uni_pc", "simple"), ("euler_ancestral", "normal"))


def test_the_native_model_computes_in_bf16_on_every_layout(recent_comfyui_server: ComfyUIServer) -> None:
    """The WanMesh Model Loader's dtype bf16 reaches ComfyUI's KSampler through the native MODEL (the GPU default):
    world 1 within BF16_BAR of the native fp32 model (and not equal to it), tp 2 and cfg parallel within
    BF16_LAYOUT_BAR of world 1."""
    latents = {}
    for name in ("world1", "tp2", "cfg_parallel2"):
        result = run_successfully(recent_comfyui_server, twin_prompt(LAYOUTS[name], pairs=BF16_PAIRS,
                                                                     seed=SEED + 7, wanmesh_dtype="bf16"))
        latents[name] = {node: saved(recent_comfyui_server, result, node)
                         for node in ("n0", "w0", "n1", "w1")}
    for pair in ("0", "1"):
        native, world1 = latents["world1"]["n" + pair], latents["world1"]["w" + pair]
        error = float((world1 - native).norm() / native.norm())
        assert 1e-4 < error <= BF16_BAR, f"{BF16_PAIRS[int(pair)]}: bf16 is {error:.3g} from native fp32"
        for layout in ("tp2", "cfg_parallel2"):
            spread = float((latents[layout]["w" + pair] - world1).norm() / world1.norm())
            assert spread <= BF16_LAYOUT_BAR, f"{layout} {BF16_PAIRS[int(pair)]}: {spread:.3g} from world 1 in bf16"


def test_the_comparison_is_sensitive(layout_latents) -> None:
    """Two samplers' latents differ far beyond the tolerance, so equal latents above are not an accident."""
    pairs = layout_latents["world1"]
    assert largest_difference(pairs["w0"], pairs["w1"]) > 100 * TOLERANCE
    assert largest_difference(pairs["n0"], pairs["n4"]) > 100 * TOLERANCE


def with_native_vace_encode(prompt: dict[str, Any]) -> dict[str, Any]:
    """Both KSamplers of pair 0 take native WanVaceToVideo's conditioning and latent (a reference image and a
    control video, two chained encodes: two VACE contexts of different strengths)."""
    prompt = dict(prompt)
    prompt["vae"] = {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}}
    prompt["video"] = {"class_type": "LoadImage", "inputs": {"image": "source_video.png"}}
    prompt["ref"] = {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}}
    size = {"width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}
    prompt["vace1"] = {"class_type": "WanVaceToVideo", "inputs": {
        "positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], **size, "strength": 1.0,
        "control_video": ["video", 0], "reference_image": ["ref", 0]}}
    prompt["vace2"] = {"class_type": "WanVaceToVideo", "inputs": {
        "positive": ["vace1", 0], "negative": ["vace1", 1], "vae": ["vae", 0], **size, "strength": 0.5,
        "reference_image": ["ref", 0]}}
    for side in ("nk0", "wk0"):
        prompt[side]["inputs"].update(positive=["vace2", 0], negative=["vace2", 1], latent_image=["vace2", 2])
    return prompt


@pytest.mark.parametrize("vace", ["default context", "WanVaceToVideo"])
def test_vace_conditioning_through_the_wanmesh_model_equals_native(recent_comfyui_server: ComfyUIServer,
                                                                   vace: str) -> None:
    """A VACE model on both sides, with no VACE encode (the native default context) or with two chained native
    WanVaceToVideo contexts: the same latents."""
    prompt = twin_prompt(LAYOUTS["world1"], VACE_FILE, pairs=SAMPLERS[:1])
    if vace == "WanVaceToVideo":
        prompt = with_native_vace_encode(prompt)
    result = run_successfully(recent_comfyui_server, prompt)
    native, wanmesh = saved(recent_comfyui_server, result, "n0"), saved(recent_comfyui_server, result, "w0")
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"VACE model ({vace}): WanMesh MODEL is {difference:.3g} from the native model"


NATIVE_WORKFLOWS = {"t2v_native_ksampler": "EmptyHunyuanLatentVideo", "t2v_native_auto_layout": "EmptyHunyuanLatentVideo",
                    "wan22_native_ksampler_advanced": "EmptyHunyuanLatentVideo",
                    "fun_control_native": "WanFunControlToVideo", "fun_inp_native": "WanFunInpaintToVideo"}


@pytest.mark.parametrize("name", NATIVE_WORKFLOWS)
def test_native_sampler_workflows_run_as_api_prompts(recent_comfyui_server: ComfyUIServer, name: str) -> None:
    """The example workflows (WanMesh models into native KSampler / two chained KSamplerAdvanced, native VAE
    decode; the Wan 2.1 Fun ones with native Fun conditioning) run as API prompts and write an MP4 of the
    latent's frames."""
    prompt = load_workflow(f"native/api/{name}.json")
    latent = node_of_type(prompt, NATIVE_WORKFLOWS[name])["inputs"]
    result = run_successfully(recent_comfyui_server, prompt)
    assert_video(saved_video(recent_comfyui_server, result, prompt), latent["length"], latent["width"],
                 latent["height"])


def test_interrupt_stops_native_ksampler_on_the_wanmesh_model_and_the_pool_stays(
        recent_comfyui_server: ComfyUIServer) -> None:
    """ComfyUI's progress events come from its own KSampler; POST /interrupt ends the prompt as interrupted long
    before its last step, and the same workers serve the next prompt."""
    prompt = load_workflow("native/api/t2v_native_ksampler.json")
    long_prompt = with_inputs(prompt, "KSampler", steps=LONG_RUN_STEPS)
    sampler_id = next(node_id for node_id, node in long_prompt.items() if node["class_type"] == "KSampler")
    server = recent_comfyui_server
    with server.listen() as listener:
        prompt_id = submit_with_events(server, long_prompt, listener)
        listener.wait_for(lambda event: bool(progress_of([event], prompt_id, sampler_id)), 420.0,
                          "progress event from KSampler")
        workers_before = {proc.pid for proc in server.descendants()}
        server.interrupt()
        listener.wait_for(is_interruption_of(prompt_id), INTERRUPT_DEADLINE_S, "execution_interrupted event")
        result = server.wait_for(prompt_id, INTERRUPT_DEADLINE_S)
        progress = progress_of(listener.events(), prompt_id, sampler_id)
    assert result.status == "error" and not [k for k, _ in result.messages if k == "execution_error"], (
        result.error_text())
    assert progress[-1]["value"] < LONG_RUN_STEPS // 2, f"KSampler went on to step {progress[-1]['value']}"
    run_successfully(server, with_inputs(prompt, "KSampler", seed=random.randint(0, MAX_SEED)))
    assert {proc.pid for proc in server.descendants()} == workers_before, "the interrupt replaced the worker pool"
