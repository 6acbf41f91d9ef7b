"""ComfyUI's LoRA loaders and model patches on the WanMesh MODEL equal them on the native model (recent ComfyUI).

One prompt per pool layout chains two ``LoraLoaderModelOnly`` (strengths 0.8 and -0.5) on native ``UNETLoader``'s
model of the tiny native twin and on the WanMesh MODEL of the same file, and the same two LoRAs through the WanMesh
LoRA Loader: KSampler 4 steps, all three within 1e-4, and tp 2, ulysses 2, cfg 2 equal world 1. The world-1
prompt also runs ``SkipLayerGuidanceDiTSimple`` and ``EasyCache`` on both models (EasyCache must skip steps on the
WanMesh MODEL, as its log says). Bad LoRAs (NaN values, another model width, keys that fit nothing) stop the
prompt with one line naming the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, RejectedPrompt
from safetensors import safe_open
from safetensors.torch import save_file
from test_comfyui_server import run_successfully
from test_native_sampling import (LAYOUTS, MODEL_FILE, TEXT_ENCODER_FILE, TOLERANCE, largest_difference,
                                  pool_inputs, save_latent, saved)

LORA_A, LORA_B = "wan_native_lora_a.safetensors", "wan_native_lora_b.safetensors"
LORA_NAN, LORA_NO_MATCH = "wan_native_lora_nan.safetensors", "wan_native_lora_nomatch.safetensors"
LORA_OTHER_WIDTH = "wan_tiny_lora_comfy.safetensors"  # made for the tiny T2V model, whose layers are narrower
STRENGTHS = (0.8, -0.5)
PATCH_LAYOUTS = ("world1", "tp2", "ulysses2", "cfg_parallel2")
STEPS, CFG, SEED = 4, 5.0, 99
RANK = 4


def _lora(shapes: dict[str, tuple[int, ...]], seed: int, nan: bool = False) -> dict[str, torch.Tensor]:
    """Rank-4 factors on every block linear, a bias delta on the FFN and a norm delta (ComfyUI key layout)."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in sorted(shapes.items()):
        name = f"diffusion_model.{key.removesuffix('.weight')}"
        if key.startswith("blocks.") and key.endswith(".weight") and len(shape) == 2:
            state[f"{name}.lora_up.weight"] = torch.randn(shape[0], RANK, generator=generator) * 0.1
            state[f"{name}.lora_down.weight"] = torch.randn(RANK, shape[1], generator=generator) * 0.1
            state[f"{name}.alpha"] = torch.tensor(8.0)
        elif key.endswith("ffn.0.bias"):
            state[f"{name.removesuffix('.bias')}.diff_b"] = torch.randn(shape, generator=generator) * 0.05
        elif key.endswith("norm3.weight"):
            state[f"{name}.diff"] = torch.randn(shape, generator=generator) * 0.05
    if nan:
        first = next(key for key in state if key.endswith("lora_up.weight"))
        state[first][0, 0] = float("nan")
    return state


@pytest.fixture(scope="module")
def native_loras(tiny_models_dir: Path) -> None:
    """LoRAs for the native twin, written next to the tiny models before the server lists its LoRA folder."""
    with safe_open(str(tiny_models_dir / "diffusion_models" / MODEL_FILE), "pt") as handle:
        shapes = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}
    loras = tiny_models_dir / "loras"
    for name, state in ((LORA_A, _lora(shapes, 1)), (LORA_B, _lora(shapes, 2)), (LORA_NAN, _lora(shapes, 3, True)),
                        (LORA_NO_MATCH, {"vae.decoder.lora_up.weight": torch.ones(4, 2),
                                         "vae.decoder.lora_down.weight": torch.ones(2, 4)})):
        save_file(state, str(loras / name))


@pytest.fixture(scope="module")
def server(native_loras, recent_comfyui_server: ComfyUIServer) -> ComfyUIServer:
    return recent_comfyui_server


def _ksampler(model: list, name: str) -> dict[str, dict[str, Any]]:
    return {f"k{name}": {"class_type": "KSampler", "inputs": {
        "model": model, "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["latent", 0], "seed": SEED,
        "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
            name: save_latent(f"k{name}", name)}


def _lora_chain(start: list, side: str, node: str, names=(LORA_A, LORA_B)) -> tuple[dict, list]:
    """Two LoRA loaders (``node``: LoraLoaderModelOnly or WanMeshLoraLoader) after ``start``."""
    nodes, model = {}, start
    for index, (name, strength) in enumerate(zip(names, STRENGTHS)):
        inputs = {"model": model, "lora_name": name}
        inputs.update({"strength_model": strength} if node == "LoraLoaderModelOnly" else {"strength": strength})
        nodes[f"{side}l{index}"] = {"class_type": node, "inputs": inputs}
        model = [f"{side}l{index}", 0]
    return nodes, model


def base_prompt(layout: dict[str, Any]) -> dict[str, Any]:
    return {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(layout)},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": TEXT_ENCODER_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a red fox in snow"}},
        "neg": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "blurry"}},
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"}},
        "wm": {"class_type": "WanMeshModelLoader",
               "inputs": {"model_name": MODEL_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}},
        "latent": {"class_type": "EmptyHunyuanLatentVideo",
                   "inputs": {"width": 48, "height": 32, "length": 5, "batch_size": 1}},
    }


def patch_prompt(layout: dict[str, Any], with_patches: bool) -> dict[str, Any]:
    """``n``/``w``/``m``: native, WanMesh MODEL and WanMesh LoRA Loader with the two LoRAs; with patches also
    ``b`` (native without LoRA), ``ns``/``ws`` (SkipLayerGuidanceDiTSimple) and ``ne``/``we`` (EasyCache)."""
    prompt = base_prompt(layout)
    for side, start, node in (("n", ["unet", 0], "LoraLoaderModelOnly"), ("w", ["wmodel", 0], "LoraLoaderModelOnly"),
                              ("m", ["wm", 0], "WanMeshLoraLoader")):
        nodes, model = _lora_chain(start, side, node)
        prompt.update(nodes)
        if side == "m":
            prompt["mmodel"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": model}}
            model = ["mmodel", 0]
        prompt.update(_ksampler(model, side))
    if with_patches:
        prompt.update(_ksampler(["unet", 0], "b"))
        for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0])):
            prompt[f"{side}slg"] = {"class_type": "SkipLayerGuidanceDiTSimple", "inputs": {
                "model": model, "double_layers": "1", "single_layers": "", "start_percent": 0.0, "end_percent": 1.0}}
            prompt.update(_ksampler([f"{side}slg", 0], f"{side}s"))
            prompt[f"{side}ec"] = {"class_type": "EasyCache", "inputs": {
                "model": model, "reuse_threshold": 1.0, "start_percent": 0.0, "end_percent": 1.0, "verbose": True}}
            prompt.update(_ksampler([f"{side}ec", 0], f"{side}e"))
    return prompt


@pytest.fixture(scope="module")
def latents(server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    found = {}
    for name in PATCH_LAYOUTS:
        with_patches = name == "world1"
        result = run_successfully(server, patch_prompt(LAYOUTS[name], with_patches))
        nodes = ["n", "w", "m"] + (["b", "ns", "ws", "ne", "we"] if with_patches else [])
        found[name] = {node: saved(server, result, node) for node in nodes}
    return found


def test_comfyui_lora_loaders_on_wanmesh_model_equal_native(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["n"], world1["b"]) > 100 * TOLERANCE, "the LoRAs change nothing: no proof"
    assert largest_difference(world1["n"], world1["w"]) <= TOLERANCE
    assert largest_difference(world1["n"], world1["m"]) <= TOLERANCE, "WanMesh LoRA Loader differs from native"


@pytest.mark.parametrize("layout", PATCH_LAYOUTS[1:])
def test_lora_loaders_in_parallel_layouts_equal_world1(latents, layout: str) -> None:
    for node in ("w", "m"):
        assert largest_difference(latents[layout][node], latents["world1"][node]) <= TOLERANCE, (layout, node)


def test_skip_layer_guidance_on_wanmesh_model_equals_native(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["ns"], world1["b"]) > 100 * TOLERANCE, "skipping a layer changes nothing"
    assert largest_difference(world1["ns"], world1["ws"]) <= TOLERANCE


def test_easycache_on_wanmesh_model_equals_native_and_skips_steps(latents, server: ComfyUIServer) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["ne"], world1["we"]) <= TOLERANCE
    skipped = [int(count) for count in re.findall(r"EasyCache - skipped (\d+)/\d+ steps", server.log())]
    assert len(skipped) >= 2 and all(count > 0 for count in skipped), skipped


@pytest.mark.parametrize("lora, what", [(LORA_NAN, "NaN or Inf"), (LORA_OTHER_WIDTH, "for another model"),
                                        (LORA_NO_MATCH, "for another model")])
def test_bad_lora_on_wanmesh_model_is_one_line_naming_the_file(server: ComfyUIServer, lora: str, what: str) -> None:
    prompt = base_prompt(LAYOUTS["world1"])
    nodes, model = _lora_chain(["wmodel", 0], "w", "LoraLoaderModelOnly", names=(lora,))
    prompt.update(nodes)
    prompt.update(_ksampler(model, "w"))
    result = server.run(prompt, 300)
    assert not isinstance(result, RejectedPrompt) and result.status == "error", result
    message = result.error_text()
    assert lora in message and what in message, message
