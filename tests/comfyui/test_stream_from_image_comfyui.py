"""Streaming from a start image in a real ComfyUI (recent), as API prompts: the WanMesh Stream Sampler's first latent
frame equals native ``ImageScale`` (bilinear, center crop, as ARVideoI2V resizes) + ``VAEEncode`` of the same image
on the same VAE file, the image changes the frames generated after it, the stream_i2v example workflow runs, and a
start image without a vae is a one-line error that leaves the server running."""

from __future__ import annotations

from typing import Any

from comfyui_server import ComfyUIServer, RejectedPrompt
from test_comfyui_server import run_successfully
from test_native_sampling import TOLERANCE, largest_difference, pool_inputs, save_latent, saved
from workflow_graph import load_workflow, node_of_type

from wanmesh.parallel import read_video

WIDTH, HEIGHT, LENGTH = 64, 32, 13  # 4 latent frames: the start frame, then chunks of 2 as 2 + 1


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
                                                          "width": WIDTH, "height": HEIGHT, "crop": "center"}},
        "encoded": {"class_type": "VAEEncode", "inputs": {"pixels": ["scaled", 0], "vae": ["vae", 0]}},
        "native": save_latent("encoded", "stream_image_native"),
        "empty": {"class_type": "WanMeshEmptyLatent",
                  "inputs": {"width": WIDTH, "height": HEIGHT, "length": LENGTH, "batch_size": 1}},
        "image_k": stream_sampler(start_image=True),
        "image_s": save_latent("image_k", "stream_image_wanmesh"),
        "text_k": stream_sampler(start_image=False),
        "text_s": save_latent("text_k", "stream_text_wanmesh"),
    }


def test_stream_starts_from_the_native_encode_of_the_image(recent_comfyui_server: ComfyUIServer) -> None:
    result = run_successfully(recent_comfyui_server, stream_prompt())
    native = saved(recent_comfyui_server, result, "native")
    image, text = (saved(recent_comfyui_server, result, node) for node in ("image_s", "text_s"))
    assert image.shape == text.shape == (1, 16, 4, HEIGHT // 8, WIDTH // 8)
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
