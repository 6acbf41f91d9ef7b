"""Regenerate every example workflow in ``workflows/`` (UI format and its ``api/`` twin) with one command.

Runs in a maintainer's shell::

    python tests/tools/make_workflows.py            # reads /object_info from live 2024 and recent ComfyUI servers
    python tests/tools/make_workflows.py --object-info-2024 info_2024.json --object-info-recent info_recent.json

Without snapshot flags it prepares the ComfyUI copies (``prepare_comfyui.py``), starts a server on each with
``comfyui_server.py`` and reads ``GET /object_info``, so widget order and defaults are those of the nodes as
they are now; ``--save-object-info DIR`` keeps those answers for a later run with the snapshot flags. Most
examples are written against the 2024 ComfyUI (whose frontend puts LoadImage's upload button into the prompt);
``workflows/native/`` uses nodes only recent ComfyUI versions have. Every example ends in WanMesh Save Video
(an MP4 at 16 fps); ``t2v`` also saves its frames as PNG images.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from workflow_builder import TEXT_NODE_SIZE, WorkflowBuilder  # noqa: E402
from workflow_graph import WORKFLOWS_DIR  # noqa: E402

WIDTH, HEIGHT = 64, 48
STREAM_SWITCH_PROMPT = "the fox leaps over a frozen stream"
FPS = 16.0  # Wan 2.1's frame rate
T2V_PROMPT = "a red fox running through snow"
VACE_PROMPT = "a yellow square sliding across a blue and green background"
NEGATIVE = "blurry, low quality"
COLUMNS = [-380, 0, 400, 800, 1200, 1600, 2000, 2400]  # x of each column of nodes, left to right
TWO_CPU_RANKS = {"devices": "cpu:2", "world": 2, "tp": 1, "ulysses": 1, "ring": 1, "cfg_parallel": False,
                 "vae_patch": 1, "backend": "local", "ray_address": "", "previews": True}
BOX_MASK = {"mode": "box", "width": WIDTH, "height": HEIGHT, "length": 9, "box_x": 0, "box_y": 12, "box_w": 24,
            "box_h": 24, "end_box_x": 40, "end_box_y": 12, "end_box_w": 24, "end_box_h": 24}
NATIVE_SEED = 106


# ---- pieces every example shares ---------------------------------------------------------------------------

def pool(w: WorkflowBuilder, **modes: Any) -> int:
    return w.node("WanMeshPool", [COLUMNS[0], 40], {**TWO_CPU_RANKS, **modes})


def text_and_model(w: WorkflowBuilder, pool_id: int, positive: str, model: str,
                   vace_module: str = "none", text_encoder: str = "umt5_tiny.safetensors") -> tuple[int, int, int]:
    """Text encoder loader, positive and negative prompts, model loader: (positive, negative, model) ids."""
    encoder = w.node("WanMeshTextEncoderLoader", [COLUMNS[1], 40],
                     {"text_encoder_name": text_encoder, "dtype": "auto"}, {"pool": (pool_id, 0)})
    positive_id = w.node("WanMeshTextEncode", [COLUMNS[2], 40], {"text": positive}, {"text_encoder": (encoder, 0)},
                         title="Positive prompt", size=TEXT_NODE_SIZE)
    negative_id = w.node("WanMeshTextEncode", [COLUMNS[2], 230], {"text": NEGATIVE}, {"text_encoder": (encoder, 0)},
                         title="Negative prompt", size=TEXT_NODE_SIZE)
    model_id = w.node("WanMeshModelLoader", [COLUMNS[1], 220],
                      {"model_name": model, "dtype": "auto", "vace_module": vace_module}, {"pool": (pool_id, 0)})
    return positive_id, negative_id, model_id


def wanmesh_vae(w: WorkflowBuilder, pool_id: int) -> int:
    return w.node("WanMeshVAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors", "dtype": "auto"},
                  {"pool": (pool_id, 0)})


Output = tuple[int, int]  # (node id, output slot)


def sampler(w: WorkflowBuilder, column: int, model: int, positive: Output, negative: Output, latent: Output,
            seed: int, steps: int, y: int = 40, **widgets: Any) -> int:
    values = {"seed": seed, "steps": steps, "cfg": 5.0, "shift": 3.0, "sampler_name": "unipc", "denoise": 1.0}
    return w.node("WanMeshSampler", [COLUMNS[column], y], {**values, **widgets},
                  {"model": (model, 0), "positive": positive, "negative": negative, "latent_image": latent})


def save_video(w: WorkflowBuilder, column: int, images: int, name: str) -> int:
    return w.node("WanMeshSaveVideo", [COLUMNS[column], 40], {"fps": FPS, "filename_prefix": f"wanmesh_{name}"},
                  {"images": (images, 0)}, size=[360, 320])


# ---- text to video -----------------------------------------------------------------------------------------

def t2v_graph(w: WorkflowBuilder, name: str, tile: tuple[int, int], also_png: bool,
              loras: tuple[tuple[str, float], ...] = (), seed: int = 42, model_file: str = "wan_tiny_t2v.safetensors",
              **modes: Any) -> None:
    pool_id = pool(w, **modes)
    positive, negative, model = text_and_model(w, pool_id, T2V_PROMPT, model_file)
    vae = wanmesh_vae(w, pool_id)
    latent = w.node("WanMeshEmptyLatent", [COLUMNS[2], 460], {"width": 64, "height": 64, "length": 5,
                                                               "batch_size": 1})
    for index, (lora_name, strength) in enumerate(loras):  # chained LoRA loaders between model and sampler
        model = w.node("WanMeshLoraLoader", [COLUMNS[1], 560 + 140 * index],
                       {"lora_name": lora_name, "strength": strength}, {"model": (model, 0)})
    sampled = sampler(w, 3, model, (positive, 0), (negative, 0), (latent, 0), seed=seed, steps=4)
    decode = w.node("WanMeshVAEDecode", [COLUMNS[4], 40], {"tile_px": tile[0], "overlap_px": tile[1]},
                    {"vae": (vae, 0), "samples": (sampled, 0)})
    save_video(w, 5, decode, name)
    if also_png:
        w.node("SaveImage", [COLUMNS[5], 560], {"filename_prefix": f"wanmesh_{name}"}, {"images": (decode, 0)},
               size=[360, 320])


def t2v(info: dict[str, Any]) -> WorkflowBuilder:
    w = WorkflowBuilder(info)
    t2v_graph(w, "t2v", tile=(0, 64), also_png=True)
    return w


def t2v_tp2(info: dict[str, Any]) -> WorkflowBuilder:
    w = WorkflowBuilder(info)
    t2v_graph(w, "t2v_tp2", tile=(32, 8), also_png=False, tp=2, vae_patch=2)
    return w


def t2v_lora(info: dict[str, Any]) -> WorkflowBuilder:
    w = WorkflowBuilder(info)
    loras = (("wan_tiny_lora_comfy.safetensors", 0.8), ("wan_tiny_lora_kohya.safetensors", 0.5))
    t2v_graph(w, "t2v_lora", tile=(0, 64), also_png=False, loras=loras, seed=7, tp=2)
    return w


def t2v_gguf(info: dict[str, Any]) -> WorkflowBuilder:
    """A GGUF transformer (the tiny Q8_0, kept quantized on each rank) on a tensor-parallel pool."""
    w = WorkflowBuilder(info)
    t2v_graph(w, "t2v_gguf", tile=(0, 64), also_png=False, model_file="wan_tiny_t2v_Q8_0.gguf", seed=11, tp=2)
    return w


def t2v_auto_layout(info: dict[str, Any]) -> WorkflowBuilder:
    """The two-rank pool on layout auto: the sampler picks the degrees for the job from the cost model."""
    w = WorkflowBuilder(info)
    t2v_graph(w, "t2v_auto_layout", tile=(0, 64), also_png=False, seed=13, layout="auto")
    return w


def low_noise_expert(w: WorkflowBuilder, pool_id: int, model_name: str = "wan_tiny_t2v_low.safetensors") -> int:
    """Wan 2.2's low-noise expert: a second WanMesh Model Loader on the pool, below the first."""
    return w.node("WanMeshModelLoader", [COLUMNS[1], 560],
                  {"model_name": model_name, "dtype": "auto", "vace_module": "none"}, {"pool": (pool_id, 0)},
                  title="Low-noise expert")


def wan22_two_experts(info: dict[str, Any]) -> WorkflowBuilder:
    """Two chained samplers as in native Wan 2.2 workflows: the high-noise expert runs steps 0-1 and keeps the
    leftover noise, the low-noise expert runs steps 2-5 without adding noise."""
    w = WorkflowBuilder(info)
    pool_id = pool(w, tp=2)
    positive, negative, high = text_and_model(w, pool_id, T2V_PROMPT, "wan_tiny_t2v.safetensors")
    vae = wanmesh_vae(w, pool_id)
    low = low_noise_expert(w, pool_id)
    latent = w.node("WanMeshEmptyLatent", [COLUMNS[2], 460], {"width": 64, "height": 64, "length": 5,
                                                               "batch_size": 1})
    texts = (positive, 0), (negative, 0)
    first = sampler(w, 3, high, *texts, (latent, 0), seed=42, steps=6, sampler_name="euler", end_step=2)
    second = sampler(w, 4, low, *texts, (first, 0), seed=42, steps=6, sampler_name="euler", cfg=4.0,
                     start_step=2, add_noise=False)
    decode = w.node("WanMeshVAEDecode", [COLUMNS[5], 40], {"tile_px": 0, "overlap_px": 64},
                    {"vae": (vae, 0), "samples": (second, 0)})
    save_video(w, 6, decode, "wan22_two_experts")
    return w


# ---- image to video --------------------------------------------------------------------------------------------

I2V_PROMPT = "the red circle rolls to the right"
I2V_SIZE = {"width": 64, "height": 48, "length": 9, "batch_size": 1}


def clip_vision_of(w: WorkflowBuilder, images: list[int]) -> list[int]:
    """WanMesh CLIP Vision Loader (the tiny encoder) and one WanMesh CLIP Vision Encode per image."""
    loader = w.node("WanMeshCLIPVisionLoader", [COLUMNS[0], 560], {"clip_name": "clip_vision_tiny.safetensors"})
    return [w.node("WanMeshCLIPVisionEncode", [COLUMNS[1], 700 + 160 * index], {"crop": "center"},
                   {"clip_vision": (loader, 0), "image": (image, 0)}) for index, image in enumerate(images)]


def image_to_video_graph(w: WorkflowBuilder, name: str, model: str, end_image: bool, clip: bool,
                         low_model: str | None = None, **modes: Any) -> None:
    """Start (and end) image -> WanMesh Image To Video -> WanMesh Sampler (two chained ones with a low-noise
    expert) -> decode -> MP4."""
    pool_id = pool(w, **modes)
    positive, negative, high = text_and_model(w, pool_id, I2V_PROMPT, model, text_encoder="umt5_native.safetensors")
    vae = wanmesh_vae(w, pool_id)
    images = [load_image(w, "ref_circle.png", 860)] + ([load_image(w, "ref_texture.png", 1200)] if end_image else [])
    links: dict[str, Output] = {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                                "start_image": (images[0], 0)}
    if end_image:
        links["end_image"] = (images[1], 0)
    if clip:
        encodes = clip_vision_of(w, images)
        links["clip_vision_output"] = (encodes[0], 0)
        if end_image:
            links["clip_vision_end_output"] = (encodes[1], 0)
    conditioning = w.node("WanMeshImageToVideo", [COLUMNS[2], 460], dict(I2V_SIZE), links, size=[320, 260])
    texts, latent = ((conditioning, 0), (conditioning, 1)), (conditioning, 2)
    if low_model is None:
        sampled = sampler(w, 3, high, *texts, latent, seed=5, steps=3, sampler_name="euler")
    else:
        low = low_noise_expert(w, pool_id, low_model)
        values = {"seed": 5, "steps": 4, "cfg": 5.0, "shift": 3.0, "sampler_name": "euler", "denoise": 1.0,
                  "boundary": 0.9}
        sampled = w.node("WanMeshSampler", [COLUMNS[3], 40], values,
                         {"model": (high, 0), "positive": texts[0], "negative": texts[1], "latent_image": latent,
                          "model_low_noise": (low, 0)})
    decode = w.node("WanMeshVAEDecode", [COLUMNS[4], 40], {"tile_px": 0, "overlap_px": 64},
                    {"vae": (vae, 0), "samples": (sampled, 0)})
    save_video(w, 5, decode, name)


def i2v(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.1 image-to-video: a start image and its CLIP vision tokens, on two Ulysses ranks."""
    w = WorkflowBuilder(info)
    image_to_video_graph(w, "i2v", "wan_tiny_i2v.safetensors", end_image=False, clip=True, ulysses=2)
    return w


def flf2v(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.1 first-last-frame: start and end images and both images' CLIP vision tokens, CFG parallel."""
    w = WorkflowBuilder(info)
    image_to_video_graph(w, "flf2v", "wan_tiny_flf2v.safetensors", end_image=True, clip=True, cfg_parallel=True)
    return w


def wan22_i2v_two_experts(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.2 I2V A14B: a start image (no CLIP vision), the two experts split at the I2V boundary 0.9, tp 2."""
    w = WorkflowBuilder(info)
    image_to_video_graph(w, "wan22_i2v_two_experts", "wan22_tiny_i2v_high.safetensors", end_image=False, clip=False,
                         low_model="wan22_tiny_i2v_low.safetensors", tp=2)
    return w


def ti2v_5b(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.2 TI2V 5B: the start image's latents kept in the first frames of a 48-channel latent (WanMesh Wan22
    Image To Video Latent on the Wan 2.2 VAE), sampled with euler on two Ulysses ranks."""
    w = WorkflowBuilder(info)
    pool_id = pool(w, ulysses=2)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, "wan22_tiny_ti2v.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("WanMeshVAELoader", [COLUMNS[1], 400], {"vae_name": "wan22_tiny_vae.safetensors", "dtype": "auto"},
                 {"pool": (pool_id, 0)})
    image = load_image(w, "ref_circle.png", 860)
    latent = w.node("WanMeshWan22ImageToVideoLatent", [COLUMNS[2], 460], dict(I2V_SIZE),
                    {"vae": (vae, 0), "start_image": (image, 0)})
    sampled = sampler(w, 3, model, (positive, 0), (negative, 0), (latent, 0), seed=5, steps=3, sampler_name="euler")
    decode = w.node("WanMeshVAEDecode", [COLUMNS[4], 40], {"tile_px": 0, "overlap_px": 64},
                    {"vae": (vae, 0), "samples": (sampled, 0)})
    save_video(w, 5, decode, "ti2v_5b")
    return w


def stream_graph(w: WorkflowBuilder, name: str, start_image: str | None = None,
                 switch: tuple[int, str] | None = None) -> None:
    """Causal streaming on two Ulysses ranks: chunks of 2 latent frames, each decoded, saved and announced; with
    ``start_image`` the stream starts from that image (its latent frame first); with ``switch`` (chunk, prompt)
    the prompt changes before that chunk (a WanMesh Prompt Switch). The text encoder is connected to the sampler's
    ``text_encoder`` too, so prompts typed into its live prompt while the stream runs switch it."""
    pool_id = pool(w, ulysses=2)
    encoder = w.node("WanMeshTextEncoderLoader", [COLUMNS[1], 40],
                     {"text_encoder_name": "umt5_tiny.safetensors", "dtype": "auto"}, {"pool": (pool_id, 0)})
    positive = w.node("WanMeshTextEncode", [COLUMNS[2], 40], {"text": T2V_PROMPT}, {"text_encoder": (encoder, 0)},
                      title="Positive prompt", size=TEXT_NODE_SIZE)
    model = w.node("WanMeshModelLoader", [COLUMNS[1], 220],
                   {"model_name": "wan_tiny_t2v.safetensors", "dtype": "auto", "vace_module": "none"},
                   {"pool": (pool_id, 0)})
    vae = wanmesh_vae(w, pool_id)
    latent = w.node("WanMeshEmptyLatent", [COLUMNS[2], 460], {"width": 64, "height": 64, "length": 17,
                                                               "batch_size": 1})
    links = {"model": (model, 0), "positive": (positive, 0), "latent": (latent, 0), "vae": (vae, 0),
             "text_encoder": (encoder, 0)}
    if start_image is not None:
        links["start_image"] = (load_image(w, start_image, 860), 0)
    if switch is not None:
        later = w.node("WanMeshTextEncode", [COLUMNS[2], 230], {"text": switch[1]}, {"text_encoder": (encoder, 0)},
                       title="Prompt from the switch on", size=TEXT_NODE_SIZE)
        switched = w.node("WanMeshPromptSwitch", [COLUMNS[2], 620], {"chunk": switch[0]}, {"positive": (later, 0)})
        links["prompt_switches"] = (switched, 0)
    streamed = w.node("WanMeshStreamSampler", [COLUMNS[3], 40],
                      {"seed": 42, "steps": 4, "shift": 5.0, "cfg": 1.0, "chunk": 2, "kv_window": 0, "sink": 0,
                       "filename_prefix": "wanmesh_stream", "fps": FPS, "timesteps": ""}, links, size=[360, 420])
    w.node("WanMeshSaveVideo", [COLUMNS[4], 40], {"fps": FPS, "filename_prefix": f"wanmesh_{name}"},
           {"images": (streamed, 1)}, size=[360, 320])


def stream_t2v(info: dict[str, Any]) -> WorkflowBuilder:
    """Causal streaming from the prompt alone, switching to a second prompt at chunk 2."""
    w = WorkflowBuilder(info)
    stream_graph(w, "stream_t2v", switch=(2, STREAM_SWITCH_PROMPT))
    return w


def stream_i2v(info: dict[str, Any]) -> WorkflowBuilder:
    """Causal streaming from a start image (as ComfyUI's ARVideoI2V) with the same T2V model."""
    w = WorkflowBuilder(info)
    stream_graph(w, "stream_i2v", start_image="ref_circle.png")
    return w


# ---- VACE --------------------------------------------------------------------------------------------------

def vace_tail(w: WorkflowBuilder, texts: tuple[int, int, int], vae: int, name: str, size: tuple[int, int],
              length: int, vace_links: dict[str, Output], seed: int, tile: tuple[int, int] = (0, 64),
              reference_images: str = "first") -> None:
    """WanMesh VACE encode -> sampler -> trim -> decode -> save video."""
    positive, negative, model = texts
    encode = w.node("WanMeshVaceEncode", [COLUMNS[4], 40],
                    {"width": size[0], "height": size[1], "length": length, "batch_size": 1, "strength": 1.0,
                     "reference_images": reference_images},
                    {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0), **vace_links})
    sampled = sampler(w, 5, model, (encode, 0), (encode, 1), (encode, 2), seed=seed, steps=3)
    trim = w.node("WanMeshTrimLatent", [COLUMNS[6], 40], {}, {"samples": (sampled, 0), "trim_amount": (encode, 3)})
    decode = w.node("WanMeshVAEDecode", [COLUMNS[6], 200], {"tile_px": tile[0], "overlap_px": tile[1]},
                    {"vae": (vae, 0), "samples": (trim, 0)})
    save_video(w, 7, decode, name)


def vace_start(info: dict[str, Any], positive: str = VACE_PROMPT, model: str = "wan_tiny_vace.safetensors",
               vace_module: str = "none", **modes: Any) -> tuple[WorkflowBuilder, tuple[int, int, int], int]:
    w = WorkflowBuilder(info)
    pool_id = pool(w, **modes)
    texts = text_and_model(w, pool_id, positive, model, vace_module)
    return w, texts, wanmesh_vae(w, pool_id)


def load_image(w: WorkflowBuilder, file_name: str, y: int) -> int:
    return w.node("LoadImage", [COLUMNS[2], y], {"image": file_name})


def vace_r2v(info: dict[str, Any]) -> WorkflowBuilder:
    w, texts, vae = vace_start(info, positive="a red ball rolling over a green and white checkered floor",
                               cfg_parallel=True)
    circle, texture = load_image(w, "ref_circle.png", 420), load_image(w, "ref_texture.png", 780)
    batch = w.node("ImageBatch", [COLUMNS[3], 420], {}, {"image1": (circle, 0), "image2": (texture, 0)})
    references = w.node("WanMeshVaceReference", [COLUMNS[3], 540], {"width": WIDTH, "height": HEIGHT},
                        {"images": (batch, 0)})
    vace_tail(w, texts, vae, "vace_r2v", (WIDTH, HEIGHT), 5, {"reference_image": (references, 0)}, 101,
              reference_images="all")
    return w


def vace_v2v_control(info: dict[str, Any]) -> WorkflowBuilder:
    w, texts, vae = vace_start(info, ulysses=2, vae_patch=2)
    video = load_image(w, "source_video.png", 420)
    control = w.node("WanMeshVaceControl", [COLUMNS[3], 420],
                     {"mode": "canny", "low_threshold": 100, "high_threshold": 200, "width": 0, "height": 0},
                     {"video": (video, 0)})
    vace_tail(w, texts, vae, "vace_v2v_control", (WIDTH, HEIGHT), 9, {"control_video": (control, 0)}, 102,
              tile=(32, 8))
    return w


def mask_links(mask: int) -> dict[str, Output]:
    return {"control_video": (mask, 0), "control_masks": (mask, 1)}


def vace_inpaint(info: dict[str, Any]) -> WorkflowBuilder:
    w, texts, vae = vace_start(info, positive="a white rabbit hopping across a blue and green background",
                               tp=2, vae_patch=2)
    video = load_image(w, "source_video.png", 420)
    mask = w.node("WanMeshVaceMask", [COLUMNS[3], 420], BOX_MASK, {"video": (video, 0)})
    vace_tail(w, texts, vae, "vace_inpaint", (WIDTH, HEIGHT), 9, mask_links(mask), 103, tile=(32, 8))
    return w


def vace_outpaint(info: dict[str, Any]) -> WorkflowBuilder:
    w, texts, vae = vace_start(info, cfg_parallel=True)
    video = load_image(w, "source_video.png", 420)
    mask = w.node("WanMeshVaceMask", [COLUMNS[3], 420],
                  {"mode": "outpaint", "width": WIDTH, "height": HEIGHT, "length": 9, "pad_left": 16, "pad_top": 8,
                   "pad_right": 16, "pad_bottom": 8}, {"video": (video, 0)})
    vace_tail(w, texts, vae, "vace_outpaint", (WIDTH + 32, HEIGHT + 16), 9, mask_links(mask), 104)
    return w


def vace_extend(info: dict[str, Any]) -> WorkflowBuilder:
    w, texts, vae = vace_start(info, model="wan_tiny_t2v.safetensors",
                               vace_module="wan_tiny_vace_module.safetensors", tp=2, vae_patch=2)
    video = load_image(w, "source_video.png", 420)
    mask = w.node("WanMeshVaceMask", [COLUMNS[3], 420],
                  {"mode": "extend", "width": WIDTH, "height": HEIGHT, "length": 9, "keep_first": 3, "keep_last": 0},
                  {"video": (video, 0)})
    vace_tail(w, texts, vae, "vace_extend", (WIDTH, HEIGHT), 9, mask_links(mask), 105, tile=(32, 8))
    return w


# ---- native twins (recent ComfyUI only) --------------------------------------------------------------------

def twin_inputs(w: WorkflowBuilder) -> dict[str, Output]:
    """A reference image plus a moving-box mask over the source video, the same for both twins."""
    reference = load_image(w, "ref_circle.png", 420)
    video = load_image(w, "source_video.png", 780)
    mask = w.node("WanMeshVaceMask", [COLUMNS[3], 600], BOX_MASK, {"video": (video, 0)})
    return {**mask_links(mask), "reference_image": (reference, 0)}


def vace_native(info: dict[str, Any]) -> WorkflowBuilder:
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w)
    positive, negative, model = text_and_model(w, pool_id, VACE_PROMPT, "wan_tiny_vace.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    links = twin_inputs(w)
    encode = w.node("WanVaceToVideo", [COLUMNS[4], 40],
                    {"width": WIDTH, "height": HEIGHT, "length": 9, "batch_size": 1, "strength": 1.0},
                    {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0), **links})
    sampled = sampler(w, 5, model, (encode, 0), (encode, 1), (encode, 2), seed=NATIVE_SEED, steps=3)
    trim = w.node("TrimVideoLatent", [COLUMNS[6], 40], {}, {"samples": (sampled, 0), "trim_amount": (encode, 3)})
    decode = w.node("VAEDecode", [COLUMNS[6], 200], {}, {"samples": (trim, 0), "vae": (vae, 0)})
    save_video(w, 7, decode, "vace_native")
    return w


def vace_wanmesh(info: dict[str, Any]) -> WorkflowBuilder:
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w)
    texts = text_and_model(w, pool_id, VACE_PROMPT, "wan_tiny_vace.safetensors")
    vae = wanmesh_vae(w, pool_id)
    vace_tail(w, texts, vae, "vace_wanmesh", (WIDTH, HEIGHT), 9, twin_inputs(w), NATIVE_SEED)
    return w


# ---- native samplers on the WanMesh MODEL (recent ComfyUI only) -------------------------------------------

def native_latent_and_decode(w: WorkflowBuilder) -> tuple[int, int]:
    """Native EmptyHunyuanLatentVideo and VAELoader (the Wan 2.1 latent and VAE nodes ComfyUI's templates use)."""
    latent = w.node("EmptyHunyuanLatentVideo", [COLUMNS[2], 460],
                    {"width": 64, "height": 64, "length": 5, "batch_size": 1})
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    return latent, vae


def native_model(w: WorkflowBuilder, model: int, y: int, shift: float = 3.0) -> int:
    """WanMesh Native Model -> native ModelSamplingSD3 (the shift, as ComfyUI's Wan templates set it)."""
    wrapped = w.node("WanMeshNativeModel", [COLUMNS[2], y], {}, {"model": (model, 0)})
    return w.node("ModelSamplingSD3", [COLUMNS[3], y], {"shift": shift}, {"model": (wrapped, 0)})


def native_tail(w: WorkflowBuilder, sampled: int, vae: int, name: str) -> None:
    decode = w.node("VAEDecode", [COLUMNS[5], 40], {}, {"samples": (sampled, 0), "vae": (vae, 0)})
    save_video(w, 6, decode, name)


def t2v_native_ksampler(info: dict[str, Any]) -> WorkflowBuilder:
    """A native text-to-video graph whose model comes from the pool: WanMesh loaders and Native Model, then
    ComfyUI's ModelSamplingSD3, KSampler (uni_pc / simple) and VAEDecode; CFG parallel on two CPU ranks."""
    return native_ksampler_graph(info, "t2v_native_ksampler", cfg_parallel=True)


def t2v_native_auto_layout(info: dict[str, Any]) -> WorkflowBuilder:
    """The same graph on a pool of layout auto: ComfyUI's KSampler's first model call chooses the degrees."""
    return native_ksampler_graph(info, "t2v_native_auto_layout", layout="auto")


def t2v_easycache(info: dict[str, Any]) -> WorkflowBuilder:
    """ComfyUI's EasyCache on the WanMesh MODEL: it sees every model call's output and reuses it on the steps it
    skips (its log line says how many)."""
    def easycache(w: WorkflowBuilder, model: int) -> int:
        return w.node("EasyCache", [COLUMNS[4], 620], {"reuse_threshold": 1.0, "start_percent": 0.0,
                                                        "end_percent": 1.0, "verbose": False}, {"model": (model, 0)})
    return native_ksampler_graph(info, "t2v_easycache", steps=8, patch=easycache, cfg_parallel=True)


def native_ksampler_graph(info: dict[str, Any], name: str, steps: int = 4,
                          patch: Callable[[WorkflowBuilder, int], int] | None = None,
                          **pool_modes: Any) -> WorkflowBuilder:
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, **pool_modes)
    positive, negative, model = text_and_model(w, pool_id, T2V_PROMPT, "wan_tiny_t2v.safetensors")
    latent, vae = native_latent_and_decode(w)
    model = native_model(w, model, 620)
    if patch is not None:
        model = patch(w, model)
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": steps, "cfg": 5.0, "sampler_name": "uni_pc", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (model, 0), "positive": (positive, 0),
                      "negative": (negative, 0), "latent_image": (latent, 0)})
    native_tail(w, sampled, vae, name)
    return w


def wan22_native_ksampler_advanced(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.2's two experts as native workflows chain them: two KSamplerAdvanced, the high-noise expert for
    steps 0-2 keeping its leftover noise, the low-noise one for steps 2-6 adding none; both models on one pool."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, tp=2)
    positive, negative, high = text_and_model(w, pool_id, T2V_PROMPT, "wan_tiny_t2v.safetensors")
    low = low_noise_expert(w, pool_id)
    latent, vae = native_latent_and_decode(w)
    common = {"noise_seed": 42, "steps": 6, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple"}
    texts = {"positive": (positive, 0), "negative": (negative, 0)}
    first = w.node("KSamplerAdvanced", [COLUMNS[4], 40],
                   {**common, "add_noise": "enable", "start_at_step": 0, "end_at_step": 2,
                    "return_with_leftover_noise": "enable"},
                   {"model": (native_model(w, high, 620), 0), **texts, "latent_image": (latent, 0)})
    second = w.node("KSamplerAdvanced", [COLUMNS[4], 520],
                    {**common, "add_noise": "disable", "start_at_step": 2, "end_at_step": 10000,
                     "return_with_leftover_noise": "disable"},
                    {"model": (native_model(w, low, 760), 0), **texts, "latent_image": (first, 0)})
    native_tail(w, second, vae, "wan22_native_ksampler_advanced")
    return w


def wan22_lightx2v(info: dict[str, Any]) -> WorkflowBuilder:
    """A Wan 2.2 distill-LoRA workflow as shared: each expert's WanMesh MODEL through ComfyUI's own
    LoraLoaderModelOnly and ModelSamplingSD3, two chained KSamplerAdvanced, 4 steps at cfg 1."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, ulysses=2)
    positive, negative, high = text_and_model(w, pool_id, T2V_PROMPT, "wan_tiny_t2v.safetensors")
    low = low_noise_expert(w, pool_id)
    latent, vae = native_latent_and_decode(w)

    def expert(model: int, y: int) -> int:
        wrapped = w.node("WanMeshNativeModel", [COLUMNS[2], y], {}, {"model": (model, 0)})
        lora = w.node("LoraLoaderModelOnly", [COLUMNS[3], y],
                      {"lora_name": "wan_tiny_lora_comfy.safetensors", "strength_model": 1.0}, {"model": (wrapped, 0)})
        return w.node("ModelSamplingSD3", [COLUMNS[3], y + 120], {"shift": 5.0}, {"model": (lora, 0)})

    common = {"noise_seed": 42, "steps": 4, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple"}
    texts = {"positive": (positive, 0), "negative": (negative, 0)}
    first = w.node("KSamplerAdvanced", [COLUMNS[4], 40],
                   {**common, "add_noise": "enable", "start_at_step": 0, "end_at_step": 2,
                    "return_with_leftover_noise": "enable"},
                   {"model": (expert(high, 620), 0), **texts, "latent_image": (latent, 0)})
    second = w.node("KSamplerAdvanced", [COLUMNS[4], 520],
                    {**common, "add_noise": "disable", "start_at_step": 2, "end_at_step": 10000,
                     "return_with_leftover_noise": "disable"},
                    {"model": (expert(low, 860), 0), **texts, "latent_image": (first, 0)})
    native_tail(w, second, vae, "wan22_lightx2v")
    return w


def fun_native_graph(info: dict[str, Any], name: str, model_file: str, node: str, image_inputs: tuple[str, ...],
                     **pool_modes: Any) -> WorkflowBuilder:
    """A native Wan 2.1 Fun graph whose model comes from the pool: the native Fun conditioning node (native VAE;
    the start image's CLIP vision from WanMesh CLIP Vision Encode) into KSampler on the WanMesh MODEL."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, **pool_modes)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, model_file,
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    start, other = load_image(w, "ref_circle.png", 860), load_image(w, "ref_texture.png", 1200)
    links: dict[str, Output] = {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                                "start_image": (start, 0), "clip_vision_output": (clip_vision_of(w, [start])[0], 0)}
    if "control_video" in image_inputs:
        control = w.node("RepeatImageBatch", [COLUMNS[3], 1200], {"amount": 9}, {"image": (other, 0)},
                         title="Control video")
        links["control_video"] = (control, 0)
    if "end_image" in image_inputs:
        links["end_image"] = (other, 0)
    conditioning = w.node(node, [COLUMNS[3], 460], dict(I2V_SIZE), links, size=[320, 260])
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (native_model(w, model, 620), 0), "positive": (conditioning, 0),
                      "negative": (conditioning, 1), "latent_image": (conditioning, 2)})
    native_tail(w, sampled, vae, name)
    return w


def fun_control_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.1 Fun Control: native WanFunControlToVideo (a control video and a start image) into KSampler on the
    WanMesh MODEL, tensor parallel on two CPU ranks."""
    return fun_native_graph(info, "fun_control_native", "wan_tiny_fun_control.safetensors", "WanFunControlToVideo",
                            ("control_video",), tp=2)


def fun_inp_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.1 Fun InP: native WanFunInpaintToVideo (a start and an end image) into KSampler on the WanMesh MODEL,
    CFG parallel on two CPU ranks."""
    return fun_native_graph(info, "fun_inp_native", "wan_tiny_fun_inp.safetensors", "WanFunInpaintToVideo",
                            ("end_image",), cfg_parallel=True)


def fun22_control_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.2 Fun Control A14B: native Wan22FunControlToVideo (a control video and a reference image) into
    KSampler on the WanMesh MODEL, Ulysses on two CPU ranks (the sequence split covers the reference tokens)."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, ulysses=2)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, "wan22_tiny_fun_control.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    reference, other = load_image(w, "ref_circle.png", 860), load_image(w, "ref_texture.png", 1200)
    control = w.node("RepeatImageBatch", [COLUMNS[3], 1200], {"amount": 9}, {"image": (other, 0)},
                     title="Control video")
    links: dict[str, Output] = {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                                "ref_image": (reference, 0), "control_video": (control, 0)}
    conditioning = w.node("Wan22FunControlToVideo", [COLUMNS[3], 460], dict(I2V_SIZE), links, size=[320, 260])
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (native_model(w, model, 620), 0), "positive": (conditioning, 0),
                      "negative": (conditioning, 1), "latent_image": (conditioning, 2)})
    native_tail(w, sampled, vae, "fun22_control_native")
    return w


ANIMATE_SIZE = {"width": 64, "height": 48, "length": 5, "batch_size": 1}


def animate_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.2 Animate: native WanAnimateToVideo (a character image and its CLIP vision, a pose video, a face video)
    into KSampler on the WanMesh MODEL (the face and motion encoders run on the ranks), TrimVideoLatent of the
    reference frame, native VAE decode; tensor parallel on two CPU ranks."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, tp=2)
    positive, negative, model = text_and_model(w, pool_id, "the red circle dances", "wan22_tiny_animate.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    character, face = load_image(w, "ref_circle.png", 860), load_image(w, "ref_texture.png", 1200)
    pose = w.node("RepeatImageBatch", [COLUMNS[3], 1200], {"amount": ANIMATE_SIZE["length"]}, {"image": (face, 0)},
                  title="Pose video")
    conditioning = w.node("WanAnimateToVideo", [COLUMNS[3], 460],
                          {**ANIMATE_SIZE, "continue_motion_max_frames": 5, "video_frame_offset": 0},
                          {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                           "clip_vision_output": (clip_vision_of(w, [character])[0], 0),
                           "reference_image": (character, 0), "face_video": (face, 0), "pose_video": (pose, 0)},
                          size=[320, 360])
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": 2, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (native_model(w, model, 620), 0), "positive": (conditioning, 0),
                      "negative": (conditioning, 1), "latent_image": (conditioning, 2)})
    trimmed = w.node("TrimVideoLatent", [COLUMNS[5], 460], {}, {"samples": (sampled, 0),
                                                                 "trim_amount": (conditioning, 3)})
    native_tail(w, trimmed, vae, "animate_native")
    return w


def phantom_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Phantom: native WanPhantomSubjectToVideo (two subject images, concatenated after the video's frames) into
    the WanMesh Sampler, positive against the negative_img_text output, on two Ulysses ranks (the sequence split
    covers the subject frames)."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, ulysses=2)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, "wan_native_t2v.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    first, second = load_image(w, "ref_circle.png", 860), load_image(w, "ref_texture.png", 1200)
    subjects = w.node("ImageBatch", [COLUMNS[3], 1000], {}, {"image1": (first, 0), "image2": (second, 0)},
                      title="Subject images")
    conditioning = w.node("WanPhantomSubjectToVideo", [COLUMNS[3], 460], dict(I2V_SIZE),
                          {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                           "images": (subjects, 0)}, size=[320, 260])
    sampled = sampler(w, 4, model, (conditioning, 0), (conditioning, 2), (conditioning, 3), seed=7, steps=4,
                      sampler_name="euler")
    native_tail(w, sampled, vae, "phantom_native")
    return w


ATI_TRACKS = ('[[{"x": 8, "y": 24}, {"x": 16, "y": 24}, {"x": 24, "y": 24}, {"x": 32, "y": 24}, {"x": 40, "y": 24}, '
              '{"x": 48, "y": 24}, {"x": 56, "y": 24}, {"x": 56, "y": 24}, {"x": 56, "y": 24}]]')


def ati_native(info: dict[str, Any]) -> WorkflowBuilder:
    """ATI: native WanTrackToVideo (a start image and one track in its JSON) into KSampler on the WanMesh MODEL
    of an image-to-video file, CFG parallel on two CPU ranks."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, cfg_parallel=True)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, "wan_tiny_i2v.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    start = load_image(w, "ref_circle.png", 860)
    conditioning = w.node("WanTrackToVideo", [COLUMNS[3], 460],
                          {"tracks": ATI_TRACKS, **I2V_SIZE, "temperature": 220.0, "topk": 2},
                          {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                           "start_image": (start, 0), "clip_vision_output": (clip_vision_of(w, [start])[0], 0)},
                          size=[320, 360])
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (native_model(w, model, 620), 0), "positive": (conditioning, 0),
                      "negative": (conditioning, 1), "latent_image": (conditioning, 2)})
    native_tail(w, sampled, vae, "ati_native")
    return w


def fun_camera_native(info: dict[str, Any]) -> WorkflowBuilder:
    """Wan 2.1 Fun Camera: native WanCameraEmbedding (a camera pose) and WanCameraImageToVideo (a start image and its
    CLIP vision) into KSampler on the WanMesh MODEL, Ulysses on two CPU ranks."""
    w = WorkflowBuilder(info, upload_in_prompt=False)
    pool_id = pool(w, ulysses=2)
    positive, negative, model = text_and_model(w, pool_id, I2V_PROMPT, "wan_tiny_fun_camera.safetensors",
                                               text_encoder="umt5_native.safetensors")
    vae = w.node("VAELoader", [COLUMNS[1], 400], {"vae_name": "wan_tiny_vae.safetensors"})
    start = load_image(w, "ref_circle.png", 860)
    size = {key: I2V_SIZE[key] for key in ("width", "height", "length")}
    camera = w.node("WanCameraEmbedding", [COLUMNS[2], 1200], {"camera_pose": "Pan Left", **size}, size=[320, 260])
    conditioning = w.node("WanCameraImageToVideo", [COLUMNS[3], 460], dict(I2V_SIZE),
                          {"positive": (positive, 0), "negative": (negative, 0), "vae": (vae, 0),
                           "start_image": (start, 0), "clip_vision_output": (clip_vision_of(w, [start])[0], 0),
                           "camera_conditions": (camera, 0)}, size=[320, 260])
    sampled = w.node("KSampler", [COLUMNS[4], 40],
                     {"seed": 42, "steps": 4, "cfg": 5.0, "sampler_name": "euler", "scheduler": "simple",
                      "denoise": 1.0},
                     {"model": (native_model(w, model, 620), 0), "positive": (conditioning, 0),
                      "negative": (conditioning, 1), "latent_image": (conditioning, 2)})
    native_tail(w, sampled, vae, "fun_camera_native")
    return w


# (sub-folder of workflows/, name, which /object_info, builder)
EXAMPLES: list[tuple[str, str, str, Callable[[dict[str, Any]], WorkflowBuilder]]] = [
    ("", "t2v", "2024", t2v),
    ("", "t2v_tp2", "2024", t2v_tp2),
    ("", "t2v_lora", "2024", t2v_lora),
    ("", "t2v_gguf", "2024", t2v_gguf),
    ("", "t2v_auto_layout", "2024", t2v_auto_layout),
    ("", "wan22_two_experts", "2024", wan22_two_experts),
    ("", "stream_t2v", "2024", stream_t2v),
    ("", "stream_i2v", "2024", stream_i2v),
    ("", "i2v", "2024", i2v),
    ("", "flf2v", "2024", flf2v),
    ("", "wan22_i2v_two_experts", "2024", wan22_i2v_two_experts),
    ("", "ti2v_5b", "2024", ti2v_5b),
    ("", "vace_r2v", "2024", vace_r2v),
    ("", "vace_v2v_control", "2024", vace_v2v_control),
    ("", "vace_inpaint", "2024", vace_inpaint),
    ("", "vace_outpaint", "2024", vace_outpaint),
    ("", "vace_extend", "2024", vace_extend),
    ("native", "vace_native", "recent", vace_native),
    ("native", "vace_wanmesh", "recent", vace_wanmesh),
    ("native", "t2v_native_ksampler", "recent", t2v_native_ksampler),
    ("native", "t2v_native_auto_layout", "recent", t2v_native_auto_layout),
    ("native", "wan22_native_ksampler_advanced", "recent", wan22_native_ksampler_advanced),
    ("native", "wan22_lightx2v", "recent", wan22_lightx2v),
    ("native", "t2v_easycache", "recent", t2v_easycache),
    ("native", "fun_control_native", "recent", fun_control_native),
    ("native", "fun_inp_native", "recent", fun_inp_native),
    ("native", "fun22_control_native", "recent", fun22_control_native),
    ("native", "animate_native", "recent", animate_native),
    ("native", "phantom_native", "recent", phantom_native),
    ("native", "ati_native", "recent", ati_native),
    ("native", "fun_camera_native", "recent", fun_camera_native),
]


def write_examples(object_info: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write every example under ``out_dir``; ``object_info``: ``{"2024": ..., "recent": ...}``."""
    written = []
    for subfolder, name, which, build in EXAMPLES:
        written += build(object_info[which]).write(out_dir / subfolder if subfolder else out_dir, name)
    return written


def live_object_info(which: str) -> dict[str, Any]:
    """``GET /object_info`` of a server started on the prepared ``which`` ComfyUI copy (stopped afterwards)."""
    from comfyui_server import ComfyUIServer, RecentComfyUIServer
    from prepare_comfyui import REPO_ROOT, prepare

    comfy_dir = prepare(REPO_ROOT / "build", which=which)
    server_class = RecentComfyUIServer if which == "recent" else ComfyUIServer
    with tempfile.TemporaryDirectory(prefix="wanmesh-object-info-") as work_dir:
        server = server_class(comfy_dir, Path(work_dir))
        try:
            server.start()
            return server.get_json("/object_info")
        finally:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--object-info-2024", type=Path, help="a saved /object_info of the 2024 ComfyUI")
    parser.add_argument("--object-info-recent", type=Path, help="a saved /object_info of the recent ComfyUI")
    parser.add_argument("--save-object-info", type=Path, metavar="DIR",
                        help="also write the /object_info answers used to DIR/info_2024.json, DIR/info_recent.json")
    parser.add_argument("--out", type=Path, default=WORKFLOWS_DIR, help="where to write (default: workflows/)")
    args = parser.parse_args(argv)
    snapshots = {"2024": args.object_info_2024, "recent": args.object_info_recent}
    object_info = {which: json.loads(path.read_text(encoding="utf-8")) if path else live_object_info(which)
                   for which, path in snapshots.items()}
    if args.save_object_info:
        args.save_object_info.mkdir(parents=True, exist_ok=True)
        for which, info in object_info.items():
            (args.save_object_info / f"info_{which}.json").write_text(json.dumps(info), encoding="utf-8")
    for path in write_examples(object_info, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
