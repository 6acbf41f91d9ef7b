"""Image-to-video in a real ComfyUI (recent, with native Wan nodes): native conditioning and sampling against
WanMesh's on the same tiny files, as API prompts.

For each model kind (Wan 2.1 I2V with CLIP vision tokens, FLF2V with a start and an end image, both also without
CLIP vision tokens as native runs them, a Wan 2.2 I2V A14B expert without CLIP vision, Wan 2.1 Fun InP with a start and an end image, Wan 2.1 Fun Control with a control video
and a start image) one prompt holds: native ``WanImageToVideo`` / ``WanFirstLastFrameToVideo`` /
``WanFunInpaintToVideo`` / ``WanFunControlToVideo`` conditioning
(native VAE; CLIP vision tokens from WanMesh CLIP Vision Encode, as a tiny CLIP vision cannot be loaded by native
``CLIPVisionLoader``, which knows only released sizes) sampled by native KSampler on ``UNETLoader``'s model, by
KSampler on the WanMesh MODEL and by the WanMesh Sampler; and WanMesh Image To Video's conditioning (WanMesh VAE on
the pool; not for Fun Control, which it has no input for) sampled by the WanMesh Sampler. All within 1e-4 of native;
Ulysses 2 (every kind) and tp 2 x CFG parallel 2 (the Fun kinds) equal one rank. The
start and end images have other sizes and aspects than the video, so resizing and cropping are compared too.

Streaming from a start image (the WanMesh Stream Sampler's ``start_image``, as ARVideoI2V): its first latent frame
equals native ``ImageScale`` (bilinear, center crop) + ``VAEEncode`` of the same image on the same VAE file, the
image changes the frames generated after it, the stream_i2v example workflow runs, and a start image without a vae
is a one-line error.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from comfyui_server import ComfyUIServer, RejectedPrompt
from test_comfyui_server import run_successfully
from test_native_sampling import (CFG, NATIVE_SHIFT, SEED, STEPS, TOLERANCE, largest_difference, pool_and_prompts,
                                   pool_inputs, save_latent, saved)
from workflow_graph import load_workflow, node_of_type

from wanmesh.parallel import read_video

WIDTH, HEIGHT, LENGTH = 48, 32, 9
START, END, CLIP_START, CLIP_END, CONTROL = ["start", 0], ["end", 0], ["clip_start", 0], ["clip_end", 0], ["control", 0]
# kind: (model file, native conditioning node and its image inputs, WanMesh Image To Video's image inputs or None
# where it has no counterpart)
KINDS = {
    "i2v": ("wan_tiny_i2v.safetensors", "WanImageToVideo", {"start_image": START, "clip_vision_output": CLIP_START},
            {"start_image": START, "clip_vision_output": CLIP_START}),
    "flf2v": ("wan_tiny_flf2v.safetensors", "WanFirstLastFrameToVideo",
              {"start_image": START, "end_image": END, "clip_vision_start_image": CLIP_START,
               "clip_vision_end_image": CLIP_END},
              {"start_image": START, "end_image": END, "clip_vision_output": CLIP_START,
               "clip_vision_end_output": CLIP_END}),
    "wan22_i2v": ("wan22_tiny_i2v_high.safetensors", "WanImageToVideo", {"start_image": START}, {"start_image": START}),
    # Wan 2.1 I2V and FLF2V without CLIP vision tokens, as native runs them
    "i2v_no_clip": ("wan_tiny_i2v.safetensors", "WanImageToVideo", {"start_image": START}, {"start_image": START}),
    "flf2v_no_clip": ("wan_tiny_flf2v.safetensors", "WanFirstLastFrameToVideo", {"start_image": START, "end_image": END},
                      {"start_image": START, "end_image": END}),
    # Wan 2.1 Fun InP: a start and an end image, the start image's CLIP vision (as WanFirstLastFrameToVideo)
    "fun_inp": ("wan_tiny_fun_inp.safetensors", "WanFunInpaintToVideo",
                {"start_image": START, "end_image": END, "clip_vision_output": CLIP_START},
                {"start_image": START, "end_image": END, "clip_vision_output": CLIP_START}),
    # Wan 2.1 Fun Control: a control video (shorter than the video: the rest stays empty) and a start image
    "fun_control": ("wan_tiny_fun_control.safetensors", "WanFunControlToVideo",
                    {"start_image": START, "control_video": CONTROL, "clip_vision_output": CLIP_START}, None),
}
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "ulysses2": dict(devices="cpu:2", world=2, ulysses=2),
           "tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True)}
# The kinds each layout samples: every kind on one rank and on two Ulysses ranks, the Wan 2.1 Fun kinds also with
# tensor and CFG parallelism together (their extra input channels go through the sharded patch embedding).
LAYOUT_KINDS = {"world1": tuple(KINDS), "ulysses2": tuple(KINDS), "tp2_cfg2": ("fun_inp", "fun_control")}
SIDES = ("native", "model", "sampler", "wanmesh_i2v")


def sides(kind: str) -> tuple[str, ...]:
    return SIDES if KINDS[kind][3] is not None else SIDES[:3]


def native_conditioning(kind: str) -> dict[str, Any]:
    _, node, images, _ = KINDS[kind]
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, **images}
    return {"class_type": node, "inputs": inputs}


def wanmesh_conditioning(kind: str) -> dict[str, Any]:
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["wvae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, **KINDS[kind][3]}
    return {"class_type": "WanMeshImageToVideo", "inputs": inputs}


def ksampler(model: str, conditioning: str) -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": [model, 0], "positive": [conditioning, 0], "negative": [conditioning, 1],
        "latent_image": [conditioning, 2], "seed": SEED, "steps": STEPS, "cfg": CFG, "sampler_name": "euler",
        "scheduler": "simple", "denoise": 1.0}}


def wanmesh_sampler(model: str, conditioning: str) -> dict[str, Any]:
    return {"class_type": "WanMeshSampler", "inputs": {
        "model": [model, 0], "positive": [conditioning, 0], "negative": [conditioning, 1],
        "latent_image": [conditioning, 2], "seed": SEED, "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT,
        "sampler_name": "euler", "denoise": 1.0, "scheduler": "simple"}}


def i2v_prompt(layout: dict[str, Any], kinds: tuple[str, ...] = tuple(KINDS)) -> dict[str, Any]:
    """Every kind's four samplings; node ``{kind}_{side}`` saves the latent of that side."""
    prompt: dict[str, Any] = {
        **pool_and_prompts(layout),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "wvae": {"class_type": "WanMeshVAELoader",
                 "inputs": {"vae_name": "wan_tiny_vae.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "end": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        "clip": {"class_type": "WanMeshCLIPVisionLoader", "inputs": {"clip_name": "clip_vision_tiny.safetensors"}},
        "clip_start": {"class_type": "WanMeshCLIPVisionEncode",
                       "inputs": {"clip_vision": ["clip", 0], "image": ["start", 0], "crop": "center"}},
        "clip_end": {"class_type": "WanMeshCLIPVisionEncode",
                     "inputs": {"clip_vision": ["clip", 0], "image": ["end", 0], "crop": "center"}},
        "control": {"class_type": "RepeatImageBatch", "inputs": {"image": ["end", 0], "amount": 5}},
    }
    for kind in kinds:
        model_file = KINDS[kind][0]
        prompt[f"{kind}_unet"] = {"class_type": "UNETLoader", "inputs": {"unet_name": model_file, "weight_dtype": "default"}}
        prompt[f"{kind}_wm"] = {"class_type": "WanMeshModelLoader",
                                "inputs": {"model_name": model_file, "dtype": "fp32", "pool": ["pool", 0]}}
        prompt[f"{kind}_wmodel"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": [f"{kind}_wm", 0]}}
        prompt[f"{kind}_cond"] = native_conditioning(kind)
        samplers = {"native": ksampler(f"{kind}_unet", f"{kind}_cond"),
                    "model": ksampler(f"{kind}_wmodel", f"{kind}_cond"),
                    "sampler": wanmesh_sampler(f"{kind}_wm", f"{kind}_cond")}
        if "wanmesh_i2v" in sides(kind):
            prompt[f"{kind}_wcond"] = wanmesh_conditioning(kind)
            samplers["wanmesh_i2v"] = wanmesh_sampler(f"{kind}_wm", f"{kind}_wcond")
        for side, node in samplers.items():
            prompt[f"{kind}_{side}_k"] = node
            prompt[f"{kind}_{side}"] = save_latent(f"{kind}_{side}_k", f"i2v_{kind}_{side}")
    return prompt


@pytest.fixture(scope="module")
def layout_latents(recent_comfyui_server: ComfyUIServer) -> dict[str, dict[str, torch.Tensor]]:
    latents = {}
    for name, layout in LAYOUTS.items():
        result = run_successfully(recent_comfyui_server, i2v_prompt(layout, LAYOUT_KINDS[name]))
        latents[name] = {f"{kind}_{side}": saved(recent_comfyui_server, result, f"{kind}_{side}")
                         for kind in LAYOUT_KINDS[name] for side in sides(kind)}
    return latents


@pytest.mark.parametrize("kind, side", [(kind, side) for kind in KINDS for side in sides(kind)[1:]])
def test_wanmesh_equals_native_image_to_video(layout_latents, kind: str, side: str) -> None:
    native, wanmesh = layout_latents["world1"][f"{kind}_native"], layout_latents["world1"][f"{kind}_{side}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{kind} {side}: {difference:.3g} from native"


@pytest.mark.parametrize("layout, kind", [(layout, kind) for layout, kinds in LAYOUT_KINDS.items()
                                          if layout != "world1" for kind in kinds])
def test_parallel_layout_equals_one_rank(layout_latents, layout: str, kind: str) -> None:
    for side in sides(kind)[1:]:
        difference = largest_difference(layout_latents[layout][f"{kind}_{side}"],
                                        layout_latents["world1"][f"{kind}_{side}"])
        assert difference <= TOLERANCE, f"{layout} {kind} {side}: {difference:.3g} from world 1"


def test_the_kinds_differ(layout_latents) -> None:
    """The image conditioning reaches the models: the kinds' latents differ far beyond the tolerance."""
    world1 = layout_latents["world1"]
    assert largest_difference(world1["i2v_native"], world1["flf2v_native"]) > 100 * TOLERANCE
    for kind in ("i2v", "flf2v"):  # and so do the CLIP vision tokens
        assert largest_difference(world1[f"{kind}_native"], world1[f"{kind}_no_clip_native"]) > 100 * TOLERANCE



# ---- streaming from a start image ---------------------------------------------------------------------------------

STREAM_WIDTH, STREAM_HEIGHT, STREAM_LENGTH = 64, 32, 13  # 4 latent frames: the start frame, then chunks 2 + 1


def stream_sampler(start_image: bool, vae: bool = True) -> dict[str, Any]:
    inputs = {"model": ["model", 0], "positive": ["pos", 0], "latent": ["empty", 0], "seed": 9, "steps": 2,
              "shift": 5.0, "cfg": 1.0, "chunk": 2, "kv_window": 0, "sink": 0, "fps": 16.0, "timesteps": "",
              "filename_prefix": f"stream_image/{'image' if start_image else 'text'}"}
    if vae:
        inputs["vae"] = ["wvae", 0]
    if start_image:
        inputs["start_image"] = ["image", 0]
    return {"class_type": "WanMeshStreamSampler", "inputs": inputs}


def stream_prompt() -> dict[str, Any]:
    """Node ``native`` saves native ImageScale + VAEEncode of the image; ``image`` / ``text`` the streams with and
    without it."""
    return {
        "pool": {"class_type": "WanMeshPool", "inputs": pool_inputs(dict(devices="cpu:2", world=2, ulysses=2))},
        "te": {"class_type": "WanMeshTextEncoderLoader",
               "inputs": {"text_encoder_name": "umt5_tiny.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "pos": {"class_type": "WanMeshTextEncode", "inputs": {"text_encoder": ["te", 0], "text": "a fox runs"}},
        "model": {"class_type": "WanMeshModelLoader",
                  "inputs": {"model_name": "wan_tiny_t2v.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "wvae": {"class_type": "WanMeshVAELoader",
                 "inputs": {"vae_name": "wan_tiny_vae.safetensors", "dtype": "fp32", "pool": ["pool", 0]}},
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "image": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},  # another size and aspect
        "scaled": {"class_type": "ImageScale", "inputs": {"image": ["image", 0], "upscale_method": "bilinear",
                                                          "width": STREAM_WIDTH, "height": STREAM_HEIGHT,
                                                          "crop": "center"}},
        "encoded": {"class_type": "VAEEncode", "inputs": {"pixels": ["scaled", 0], "vae": ["vae", 0]}},
        "native": save_latent("encoded", "stream_image_native"),
        "empty": {"class_type": "WanMeshEmptyLatent",
                  "inputs": {"width": STREAM_WIDTH, "height": STREAM_HEIGHT, "length": STREAM_LENGTH,
                             "batch_size": 1}},
        "image_k": stream_sampler(start_image=True),
        "image_s": save_latent("image_k", "stream_image_wanmesh"),
        "text_k": stream_sampler(start_image=False),
        "text_s": save_latent("text_k", "stream_text_wanmesh"),
    }


def test_stream_starts_from_the_native_encode_of_the_image(recent_comfyui_server: ComfyUIServer) -> None:
    result = run_successfully(recent_comfyui_server, stream_prompt())
    native = saved(recent_comfyui_server, result, "native")
    image, text = (saved(recent_comfyui_server, result, node) for node in ("image_s", "text_s"))
    assert image.shape == text.shape == (1, 16, 4, STREAM_HEIGHT // 8, STREAM_WIDTH // 8)
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(image[:, :, :1], native)
    assert difference <= TOLERANCE, f"the stream's first frame is {difference:.3g} from native VAEEncode"
    assert largest_difference(image[:, :, 1:], text[:, :, 1:]) > 100 * TOLERANCE, "the image did not reach the stream"


def test_start_image_without_a_vae_is_one_line_and_the_server_goes_on(recent_comfyui_server: ComfyUIServer) -> None:
    prompt = stream_prompt()
    prompt["image_k"] = stream_sampler(start_image=True, vae=False)
    for node in ("native", "encoded", "scaled", "vae", "text_s", "text_k"):
        prompt.pop(node)
    failed = recent_comfyui_server.run(prompt, 300)
    assert not isinstance(failed, RejectedPrompt) and failed.status == "error"
    error = failed.error_text()
    assert "start_image needs the vae input" in error, error


def test_stream_i2v_workflow_runs_chunk_zero_is_the_start_frame(recent_comfyui_server: ComfyUIServer) -> None:
    """The example workflow as an API prompt (after the failed prompt above: the server went on): chunk 0 is the
    start image's one frame, then chunks of 2 latent frames (8 image frames each); the whole video has them all."""
    prompt = load_workflow("api/stream_i2v.json")
    result = run_successfully(recent_comfyui_server, prompt)
    sampler_id = next(key for key, node in prompt.items() if node["class_type"] == "WanMeshStreamSampler")
    outputs = result.outputs[sampler_id]
    folder = recent_comfyui_server.output_dir / outputs["subfolder"][0]
    chunks = [read_video(folder / name).shape[0] for name in outputs["chunk_files"]]
    length = node_of_type(prompt, "WanMeshEmptyLatent")["inputs"]["length"]
    assert chunks == [1, 8, 8] and sum(chunks) == length
    assert read_video(folder / outputs["video_file"][0]).shape[0] == length
