"""Wan 2.2 TI2V 5B in a real ComfyUI (recent, with native Wan 2.2 nodes): the tiny 48-channel TI2V transformer
(``wan22_tiny_ti2v``) sampled natively against WanMesh, as API prompts, and WanMesh's Wan22 Image To Video Latent
against native ``Wan22ImageToVideoLatent``.

Each sampling case runs three samplers on one LATENT, with the same seed and settings: native KSampler on
``UNETLoader``'s model (ComfyUI's WAN22 with the Wan22 latent format: the independent reference), KSampler on the
WanMesh MODEL (ComfyUI's WAN22 whose transformer runs on the pool, called with per-frame timesteps) and the WanMesh
Sampler (the whole loop on the pool, the noise mask handled by the workers). Cases: text-to-video on native
``Wan22ImageToVideoLatent``'s empty 48-channel latent; a noise mask on a sampled latent (native SetLatentNoiseMask with
a MASK of three frames: kept, half, sampled; made at another size than the latent's, so ComfyUI's resizing is compared
too), also with uni_pc, euler_ancestral, dpmpp_2m and lcm on other schedulers (native KSampler against the WanMesh
Sampler); and, when the pack registers its node, the start-image LATENT of WanMesh Wan22 Image To Video Latent (tiny Wan
2.2 VAE on the pool). All within 1e-4 of native; ulysses 2 equals one rank.

The tiny Wan 2.2 VAE cannot be loaded by native ``VAELoader`` (ComfyUI builds every Wan 2.2 VAE at the release
widths), so the node's LATENT is compared with native ``Wan22ImageToVideoLatent`` in a subprocess inside the ComfyUI
copy that builds ComfyUI's VAE at the tiny file's widths (as ``test_native_vae22.py`` does).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer
from native_scripts import NATIVE_VAE22
from safetensors.torch import load_file, save_file
from test_comfyui_server import run_successfully
from test_native_sampling import (CFG, NATIVE_SHIFT, SEED, TOLERANCE, largest_difference, pool_and_prompts,
                                   save_latent, saved)

MODEL_FILE = "wan22_tiny_ti2v.safetensors"
WAN21_VAE_FILE = "wan_tiny_vae.safetensors"  # Wan22ImageToVideoLatent without a start image never calls its VAE
WAN22_VAE_FILE = "wan22_tiny_vae.safetensors"  # the tiny Wan 2.2 VAE (parallel/tiny/vae22.py)
WANMESH_LATENT_NODE = "WanMeshWan22ImageToVideoLatent"
WIDTH, HEIGHT, LENGTH, STEPS = 64, 48, 9, 3  # a 4 x 3 latent of 3 frames at the Wan 2.2 VAE's 16x
MASK_COLORS = (0x000000, 0x808080, 0xFFFFFF)  # per latent frame: kept, half sampled, sampled
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2)}
SIDES = ("native", "model", "sampler")


# The noise mask with the workers' other ComfyUI samplers and schedulers: native KSampler against the WanMesh Sampler
MASKED_SAMPLERS = {"masked_unipc": ("uni_pc", "beta"), "masked_ancestral": ("euler_ancestral", "normal"),
                   "masked_dpmpp": ("dpmpp_2m", "karras"), "masked_lcm": ("lcm", "sgm_uniform")}


def ksampler(model: str, latent: list, seed: int, sampler: str = "euler", scheduler: str = "simple") -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": [model, 0], "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": latent, "seed": seed,
        "steps": STEPS, "cfg": CFG, "sampler_name": sampler, "scheduler": scheduler, "denoise": 1.0}}


def wanmesh_sampler(latent: list, seed: int, sampler: str = "euler", scheduler: str = "simple") -> dict[str, Any]:
    return {"class_type": "WanMeshSampler", "inputs": {
        "model": ["wm", 0], "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": latent, "seed": seed,
        "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT, "sampler_name": sampler, "denoise": 1.0,
        "scheduler": scheduler}}


def _three_samplers(prompt: dict[str, Any], case: str, latent: list, seed: int) -> None:
    """Native KSampler, KSampler on the WanMesh MODEL and the WanMesh Sampler on ``latent``; ``{case}_{side}``
    saves each result, ``{case}_{side}_k`` is the sampler."""
    samplers = {"native": ksampler("unet", latent, seed), "model": ksampler("wmodel", latent, seed),
                "sampler": wanmesh_sampler(latent, seed)}
    for side, node in samplers.items():
        prompt[f"{case}_{side}_k"] = node
        prompt[f"{case}_{side}"] = save_latent(f"{case}_{side}_k", f"ti2v_{case}_{side}")


def _mask_nodes(prompt: dict[str, Any]) -> list:
    """A MASK [3, 24, 32] made from solid images (0, 128/255 and 1): one frame per latent frame, at another size
    than the latent's, so the sampler resizes it as ComfyUI resizes noise masks."""
    for index, color in enumerate(MASK_COLORS):
        prompt[f"mask_image{index}"] = {"class_type": "EmptyImage", "inputs": {
            "width": 32, "height": 24, "batch_size": 1, "color": color}}
    prompt["mask_batch01"] = {"class_type": "ImageBatch",
                              "inputs": {"image1": ["mask_image0", 0], "image2": ["mask_image1", 0]}}
    prompt["mask_batch"] = {"class_type": "ImageBatch",
                            "inputs": {"image1": ["mask_batch01", 0], "image2": ["mask_image2", 0]}}
    prompt["mask"] = {"class_type": "ImageToMask", "inputs": {"image": ["mask_batch", 0], "channel": "red"}}
    return ["mask", 0]


def ti2v_prompt(layout: dict[str, Any], wanmesh_node: bool) -> dict[str, Any]:
    prompt: dict[str, Any] = {
        **pool_and_prompts(layout),
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_FILE, "weight_dtype": "default"}},
        "wm": {"class_type": "WanMeshModelLoader",
               "inputs": {"model_name": MODEL_FILE, "dtype": "fp32", "pool": ["pool", 0]}},
        "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}},
        "vae21": {"class_type": "VAELoader", "inputs": {"vae_name": WAN21_VAE_FILE}},
        "empty": {"class_type": "Wan22ImageToVideoLatent", "inputs": {
            "vae": ["vae21", 0], "width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}},
    }
    _three_samplers(prompt, "t2v", ["empty", 0], SEED)
    prompt["masked_latent"] = {"class_type": "SetLatentNoiseMask",
                               "inputs": {"samples": ["t2v_native_k", 0], "mask": _mask_nodes(prompt)}}
    _three_samplers(prompt, "masked", ["masked_latent", 0], SEED + 1)
    for case, (sampler, scheduler) in MASKED_SAMPLERS.items():
        for side, node in (("native", ksampler("unet", ["masked_latent", 0], SEED + 1, sampler, scheduler)),
                           ("sampler", wanmesh_sampler(["masked_latent", 0], SEED + 1, sampler, scheduler))):
            prompt[f"{case}_{side}_k"] = node
            prompt[f"{case}_{side}"] = save_latent(f"{case}_{side}_k", f"ti2v_{case}_{side}")
    prompt["unmasked_k"] = ksampler("unet", ["t2v_native_k", 0], SEED + 1)
    prompt["unmasked"] = save_latent("unmasked_k", "ti2v_unmasked")
    if wanmesh_node:
        prompt["start"] = {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}}
        prompt["wvae22"] = {"class_type": "WanMeshVAELoader",
                            "inputs": {"vae_name": WAN22_VAE_FILE, "dtype": "fp32", "pool": ["pool", 0]}}
        prompt["i2v_latent"] = {"class_type": WANMESH_LATENT_NODE, "inputs": {
            "vae": ["wvae22", 0], "width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1,
            "start_image": ["start", 0]}}
        _three_samplers(prompt, "i2v", ["i2v_latent", 0], SEED + 2)
    return prompt


def _saved_nodes(prompt: dict[str, Any]) -> list[str]:
    return [node for node, spec in prompt.items() if spec["class_type"] == "SaveLatent"]


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    wanmesh_node = WANMESH_LATENT_NODE in recent_comfyui_server.get_json("/object_info")
    latents = {}
    for name, layout in LAYOUTS.items():
        prompt = ti2v_prompt(layout, wanmesh_node)
        result = run_successfully(recent_comfyui_server, prompt)
        latents[name] = {node: saved(recent_comfyui_server, result, node) for node in _saved_nodes(prompt)}
    return latents


def _cases(world1: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    return [(node.rsplit("_", 1)[0], node.rsplit("_", 1)[1]) for node in world1
            if node != "unmasked" and not node.endswith("_native")]


@pytest.mark.parametrize("case", ("t2v", "masked", *MASKED_SAMPLERS, "i2v"))
def test_wanmesh_equals_native_ti2v(layout_latents, case: str) -> None:
    world1 = layout_latents["world1"]
    if f"{case}_native" not in world1:
        pytest.skip(f"{WANMESH_LATENT_NODE} is not registered in nodes/__init__.py: the {case} case needs it")
    native = world1[f"{case}_native"]
    assert native.shape == (1, 48, 3, HEIGHT // 16, WIDTH // 16)
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    sides = [side for name, side in _cases(world1) if name == case]
    assert {"model", "sampler"} <= set(sides) or case in MASKED_SAMPLERS and sides == ["sampler"]
    for side in sides:
        difference = largest_difference(native, world1[f"{case}_{side}"])
        print(f"{case} {side}: {difference:.3g} from native")
        assert difference <= TOLERANCE, f"{case} {side}: {difference:.3g} from native"


def test_parallel_layout_equals_one_rank(layout_latents) -> None:
    for case, side in _cases(layout_latents["world1"]):
        difference = largest_difference(layout_latents["ulysses2"][f"{case}_{side}"],
                                        layout_latents["world1"][f"{case}_{side}"])
        assert difference <= TOLERANCE, f"ulysses 2 {case} {side}: {difference:.3g} from world 1"


def test_the_mask_keeps_its_frames_and_changes_the_video(layout_latents) -> None:
    """Natively, the masked run keeps the sampled latent's first frame, resamples the others, and differs from the
    same seed without the mask: the comparisons above could fail."""
    world1 = layout_latents["world1"]
    base, masked, unmasked = world1["t2v_native"], world1["masked_native"], world1["unmasked"]
    assert largest_difference(masked[:, :, :1], base[:, :, :1]) <= 1e-5
    assert largest_difference(masked[:, :, 2:], base[:, :, 2:]) > 100 * TOLERANCE
    assert largest_difference(masked, unmasked) > 100 * TOLERANCE


# -- the latent node against native Wan22ImageToVideoLatent (a subprocess inside the ComfyUI copy) -------------------

NATIVE_LATENT = r"""
import sys
vae_file, io_file, width, height, length, batch = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
""" + NATIVE_VAE22 + r"""
from comfy_extras.nodes_wan import Wan22ImageToVideoLatent
from safetensors.torch import load_file, save_file
vae = native_vae22(vae_file)
start = load_file(io_file)["start"]
(latent,) = Wan22ImageToVideoLatent.execute(vae, width, height, length, batch, start_image=start).result
(empty,) = Wan22ImageToVideoLatent.execute(vae, width, height, length, batch).result
save_file({"samples": latent["samples"].contiguous(), "noise_mask": latent["noise_mask"].contiguous(),
           "empty": empty["samples"].contiguous()}, io_file)
"""
NODE_LENGTH, NODE_BATCH = 13, 2  # a start of 6 frames (2 latent frames kept) of another size and aspect


@pytest.fixture(scope="module")
def start_images() -> torch.Tensor:
    return torch.rand(6, 40, 72, 3, generator=torch.Generator().manual_seed(9))


@pytest.fixture(scope="module")
def native_latent(recent_comfyui_dir: Path, tiny_models_dir: Path, start_images,
                  tmp_path_factory) -> dict[str, torch.Tensor]:
    io_file = tmp_path_factory.mktemp("native_ti2v") / "io.safetensors"
    save_file({"start": start_images}, str(io_file))
    done = subprocess.run([sys.executable, "-c", NATIVE_LATENT, str(tiny_models_dir / "vae" / WAN22_VAE_FILE),
                           str(io_file), str(WIDTH), str(HEIGHT), str(NODE_LENGTH), str(NODE_BATCH)],
                          cwd=recent_comfyui_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(io_file))


def test_the_latent_node_equals_native_wan22_image_to_video_latent(native_latent, tiny_models_dir: Path,
                                                                    start_images) -> None:
    """The start frames fitted and VAE-encoded (WanMesh's Wan 2.2 VAE, one rank), placed and masked as native."""
    from types import SimpleNamespace

    from wanmesh.nodes.ti2v import WanMeshWan22ImageToVideoLatent
    from wanmesh.parallel.worker.executors import RankExecutor

    executor = RankExecutor("cpu")
    vae = SimpleNamespace(runner=executor, handle=executor.load_vae(str(tiny_models_dir / "vae" / WAN22_VAE_FILE),
                                                                    dtype="fp32"))
    node = WanMeshWan22ImageToVideoLatent()
    (latent,) = node.encode(vae, WIDTH, HEIGHT, NODE_LENGTH, NODE_BATCH, start_image=start_images)
    (empty,) = node.encode(vae, WIDTH, HEIGHT, NODE_LENGTH, NODE_BATCH)
    assert native_latent["samples"].shape == (NODE_BATCH, 48, 4, HEIGHT // 16, WIDTH // 16)
    assert torch.equal(latent["noise_mask"], native_latent["noise_mask"])
    assert native_latent["noise_mask"][:, :, :2].eq(0).all() and native_latent["noise_mask"][:, :, 2:].eq(1).all()
    assert native_latent["samples"][:, :, :2].std() > 0.05  # the encoded start is not flat
    difference = largest_difference(latent["samples"], native_latent["samples"])
    print(f"Wan22ImageToVideoLatent samples: {difference:.3g} from native")
    assert difference <= TOLERANCE
    assert torch.equal(empty["samples"], native_latent["empty"]) and "noise_mask" not in empty
