"""Wan 2.2 Fun Control A14B (and the transformer of Wan 2.2 Fun 5B) in a real ComfyUI (recent): native ``Wan22FunControlToVideo`` conditioning (control
video, with and without its reference image) sampled by native KSampler on ``UNETLoader``'s model, by KSampler on the
WanMesh MODEL and by the WanMesh Sampler, on the tiny Fun Control file (52 input channels, a ``ref_conv``), as API
prompts. All within 1e-4 of native; tp 2 x CFG parallel 2 equals one rank (Ulysses 2 and ring 2, whose sequence
split covers the reference tokens: ``tests/distributed/test_fun22_pool.py``); the reference image changes the
result; the example workflow (Ulysses 2) runs. The same file as scaled fp8 and as a Q8_0
GGUF loads through the Model Loader and stays within its error bar of the float file. The reference and control
images have other sizes and aspects than the video, so resizing and cropping are compared too.

Transformer calls: ComfyUI's own loader (``load_diffusion_model``, as UNETLoader) reads both tiny Fun files (the A14B
Control one and the 5B Control one on 48-channel latents, 148 input channels, a 48-channel ``ref_conv``) with its
model detection, in a subprocess inside the ComfyUI copy; one call with and one without a reference latent on
each give the outputs of WanMesh's loader within 1e-4. (The 5B is not sampled here: the tiny Wan 2.2 VAE has
widths native ``VAELoader`` does not build, and Wan22FunControlToVideo needs a native VAE.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import subprocess
import sys

import gguf
import pytest
import torch
from comfyui_server import ComfyUIServer
from model_kinds import FP8, Q8, relative_error
from safetensors.torch import load_file, save_file
from test_comfyui_server import assert_video, run_successfully, saved_video
from test_native_sampling import (CFG, NATIVE_SHIFT, SEED, STEPS, TOLERANCE, largest_difference, pool_and_prompts,
                                   pool_inputs, save_latent, saved)
from workflow_graph import load_workflow, node_of_type

from wanmesh.parallel.tiny.files import TINY_FILES
from wanmesh.parallel.tiny.fp8_write import write_fp8_file
from wanmesh.parallel.tiny.gguf_write import write_wan_gguf
from wanmesh.parallel.weights.loaders import load_transformer

pytestmark = pytest.mark.timeout(900)

WIDTH, HEIGHT, LENGTH = 48, 32, 9
MODEL = Path(TINY_FILES["fun22_control"]).name
# the file kinds written from the float file: (file under diffusion_models/kinds, error bar against the float file)
FILE_KINDS = {"fp8_scaled": ("fun22_kinds/wan22_tiny_fun_control_fp8_scaled.safetensors", FP8),
              "gguf_Q8_0": ("fun22_kinds/wan22_tiny_fun_control_Q8_0.gguf", Q8)}
# Ulysses 2 and ring 2 with a reference against one device: tests/distributed/test_fun22_pool.py (and the example
# workflow below runs Ulysses 2 here)
LAYOUTS = {"world1": dict(devices="cpu:1", world=1), "tp2_cfg2": dict(devices="cpu:4", world=4, tp=2, cfg_parallel=True)}
CONDITIONINGS = ("ref", "plain")  # with the reference image, without it
SIDES = ("native", "model", "sampler")


@pytest.fixture(scope="module")
def file_kinds(tiny_models_dir: Path) -> dict[str, str]:
    """The Fun Control file as scaled fp8 and Q8_0 GGUF beside the others in the served tree."""
    state = load_file(str(tiny_models_dir / TINY_FILES["fun22_control"]))
    heads = {"num_heads": "2"}
    folder = tiny_models_dir / "diffusion_models"
    (folder / "fun22_kinds").mkdir(exist_ok=True)
    write_fp8_file(state, folder / FILE_KINDS["fp8_scaled"][0], torch.float8_e4m3fn, True, metadata=heads)
    write_wan_gguf(state, folder / FILE_KINDS["gguf_Q8_0"][0], gguf.GGMLQuantizationType.Q8_0, num_heads=2)
    return {name: file for name, (file, _) in FILE_KINDS.items()}


def conditioning(reference: bool) -> dict[str, Any]:
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": ["vae", 0], "width": WIDTH, "height": HEIGHT,
              "length": LENGTH, "batch_size": 1, "control_video": ["control", 0]}
    if reference:
        inputs["ref_image"] = ["start", 0]
    return {"class_type": "Wan22FunControlToVideo", "inputs": inputs}


def ksampler(model: str, cond: str) -> dict[str, Any]:
    return {"class_type": "KSampler", "inputs": {
        "model": [model, 0], "positive": [cond, 0], "negative": [cond, 1], "latent_image": [cond, 2], "seed": SEED,
        "steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}}


def wanmesh_sampler(model: str, cond: str) -> dict[str, Any]:
    return {"class_type": "WanMeshSampler", "inputs": {
        "model": [model, 0], "positive": [cond, 0], "negative": [cond, 1], "latent_image": [cond, 2], "seed": SEED,
        "steps": STEPS, "cfg": CFG, "shift": NATIVE_SHIFT, "sampler_name": "euler", "denoise": 1.0,
        "scheduler": "simple"}}


def loader(model_file: str) -> dict[str, Any]:
    return {"class_type": "WanMeshModelLoader", "inputs": {"model_name": model_file, "dtype": "fp32", "pool": ["pool", 0]}}


def fun22_prompt(layout: dict[str, Any], native: bool, kinds: dict[str, str] | None = None,
                 conditionings: tuple[str, ...] = CONDITIONINGS) -> dict[str, Any]:
    """Node ``{cond}_{side}`` saves the latent of one side of one conditioning (``native`` only when asked);
    ``kind_{name}`` the WanMesh Sampler's latent on a file kind, with the reference."""
    prompt: dict[str, Any] = {
        **pool_and_prompts(layout),
        "vae": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_tiny_vae.safetensors"}},
        "start": {"class_type": "LoadImage", "inputs": {"image": "ref_circle.png"}},
        "end": {"class_type": "LoadImage", "inputs": {"image": "ref_texture.png"}},
        "control": {"class_type": "RepeatImageBatch", "inputs": {"image": ["end", 0], "amount": 5}},
        "unet": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL, "weight_dtype": "default"}},
        "wm": loader(MODEL),
        "wmodel": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm", 0]}},
    }
    for name in conditionings:
        prompt[f"{name}_cond"] = conditioning(reference=name == "ref")
        samplers = {"model": ksampler("wmodel", f"{name}_cond"), "sampler": wanmesh_sampler("wm", f"{name}_cond")}
        if native:
            samplers["native"] = ksampler("unet", f"{name}_cond")
        for side, node in samplers.items():
            prompt[f"{name}_{side}_k"] = node
            prompt[f"{name}_{side}"] = save_latent(f"{name}_{side}_k", f"fun22_{name}_{side}")
    for kind, model_file in (kinds or {}).items():
        prompt[f"kind_{kind}_wm"] = loader(model_file)
        prompt[f"kind_{kind}_k"] = wanmesh_sampler(f"kind_{kind}_wm", "ref_cond")
        prompt[f"kind_{kind}"] = save_latent(f"kind_{kind}_k", f"fun22_kind_{kind}")
    return prompt


@pytest.fixture(scope="module")
def latents(recent_comfyui_server: ComfyUIServer, file_kinds) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    for name, layout in LAYOUTS.items():
        world1 = name == "world1"
        # the parallel layouts run the reference conditioning only (its tokens are what the sequence split adds)
        prompt = fun22_prompt(layout, native=world1, kinds=file_kinds if world1 else None,
                              conditionings=CONDITIONINGS if world1 else ("ref",))
        result = run_successfully(recent_comfyui_server, prompt)
        nodes = [node for node in prompt if node.startswith(("ref_", "plain_", "kind_")) and
                 prompt[node]["class_type"] == "SaveLatent"]
        results[name] = {node: saved(recent_comfyui_server, result, node) for node in nodes}
    return results


@pytest.mark.parametrize("cond, side", [(cond, side) for cond in CONDITIONINGS for side in SIDES[1:]])
def test_wanmesh_equals_native_fun22_control(latents, cond: str, side: str) -> None:
    native, wanmesh = latents["world1"][f"{cond}_native"], latents["world1"][f"{cond}_{side}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{cond} {side}: {difference:.3g} from native"


def test_the_reference_image_reaches_the_model(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["ref_native"], world1["plain_native"]) > 100 * TOLERANCE


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "world1"])
def test_parallel_layout_equals_one_rank(latents, layout: str) -> None:
    for node, latent in latents[layout].items():
        difference = largest_difference(latent, latents["world1"][node])
        assert difference <= TOLERANCE, f"{layout} {node}: {difference:.3g} from world 1"


@pytest.mark.parametrize("kind", list(FILE_KINDS))
def test_quantized_fun_files_stay_close_to_the_float_file(latents, kind: str) -> None:
    error = relative_error(latents["world1"][f"kind_{kind}"], latents["world1"]["ref_sampler"])
    assert 0 < error <= FILE_KINDS[kind][1], f"{kind}: relative error {error:.3g}"


def test_the_fun22_control_workflow_runs_as_an_api_prompt(recent_comfyui_server: ComfyUIServer) -> None:
    """The example workflow (native Wan22FunControlToVideo with a reference image into KSampler on the WanMesh
    MODEL, Ulysses 2, native VAE decode) writes an MP4 of the latent's frames."""
    prompt = load_workflow("native/api/fun22_control_native.json")
    latent = node_of_type(prompt, "Wan22FunControlToVideo")["inputs"]
    result = run_successfully(recent_comfyui_server, prompt)
    assert_video(saved_video(recent_comfyui_server, result, prompt), latent["length"], latent["width"],
                 latent["height"])


# -- one transformer call against ComfyUI's own loader and model ----------------------------------------------------

NATIVE_CALLS = r"""
import sys
io_file, paths = sys.argv[1], sys.argv[2:]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.sd
from safetensors.torch import load_file, save_file
given, out = load_file(io_file), {}
for name, path in zip(("a14b", "5b"), paths):
    model = comfy.sd.load_diffusion_model(path).model
    network = model.diffusion_model
    assert network.ref_conv is not None, "ComfyUI did not find the ref_conv"
    out[f"{name}_config"] = torch.tensor(list(network.patch_embedding.weight.shape[:2]))
    args = (given[f"{name}_x"].to(network.dtype), given["t"], given["context"].to(network.dtype))
    with torch.no_grad():
        out[f"{name}_ref"] = network(*args, reference_latent=given[f"{name}_ref"].to(network.dtype)).float()
        out[f"{name}_plain"] = network(*args).float()
save_file({key: value.contiguous() for key, value in out.items()}, io_file)
"""
CALL_SHAPES = {"a14b": ((1, 52, 3, 4, 6), (1, 16, 4, 6), "fun22_control"),
               "5b": ((1, 148, 2, 2, 4), (1, 48, 2, 4), "fun22_5b_control")}


@pytest.fixture(scope="module")
def native_calls(recent_comfyui_dir: Path, tiny_models_dir: Path, tmp_path_factory):
    generator = torch.Generator().manual_seed(3)
    given = {"t": torch.tensor([700.0]), "context": torch.randn(1, 12, 4096, generator=generator)}
    for name, (x, ref, _) in CALL_SHAPES.items():
        given[f"{name}_x"], given[f"{name}_ref"] = torch.randn(x, generator=generator), torch.randn(ref, generator=generator)
    io_file = tmp_path_factory.mktemp("fun22_calls") / "io.safetensors"
    save_file(given, str(io_file))
    paths = [str(tiny_models_dir / TINY_FILES[file]) for *_, file in CALL_SHAPES.values()]
    done = subprocess.run([sys.executable, "-c", NATIVE_CALLS, str(io_file), *paths], cwd=recent_comfyui_dir,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return given, load_file(str(io_file))


@pytest.mark.parametrize("name", list(CALL_SHAPES))
def test_the_transformer_call_equals_comfyuis_model(native_calls, tiny_models_dir: Path, name: str) -> None:
    given, native = native_calls
    x_shape, _, file = CALL_SHAPES[name]
    assert native[f"{name}_config"].tolist() == [256, x_shape[1]]
    model = load_transformer(str(tiny_models_dir / TINY_FILES[file]))
    args = dict(hidden_states=given[f"{name}_x"], timestep=given["t"], encoder_hidden_states=given["context"],
                return_dict=False)
    with torch.no_grad():
        with_ref = model(**args, reference_latent=given[f"{name}_ref"])[0]
        plain = model(**args)[0]
    assert largest_difference(native[f"{name}_ref"], native[f"{name}_plain"]) > 100 * TOLERANCE
    assert largest_difference(with_ref, native[f"{name}_ref"]) <= TOLERANCE
    assert largest_difference(plain, native[f"{name}_plain"]) <= TOLERANCE
