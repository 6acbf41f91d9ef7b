"""Wan 2.2 Fun Control A14B and Fun 5B Control in a real ComfyUI (recent): native ``Wan22FunControlToVideo``
conditioning (control video, with and without its reference image) sampled by native KSampler on ``UNETLoader``'s
model, by KSampler on the WanMesh MODEL and by the WanMesh Sampler, on the tiny Fun Control file (52 input channels, a
``ref_conv``), as API prompts. Fun 5B Control (148 input channels, a 48-channel ``ref_conv``) runs the same three
samplers with its reference image on 48-channel latents from native ``VAELoader``'s Wan 2.2 VAE: the release-width
random twin ``wanmesh make-tiny --native-vae22`` writes (ComfyUI builds no smaller Wan 2.2 VAE), whose encode and
decode by WanMesh VAE Encode / Decode on the pool equal native VAEEncode / VAEDecode. All within 1e-4 of native;
tp 2 x CFG parallel 2 equals one rank for both (Ulysses 2 and ring 2, whose sequence
split covers the reference tokens: ``tests/distributed/test_fun22_pool.py``); the reference image changes the
result; the example workflow (Ulysses 2) runs. The same file as scaled fp8 and as a Q8_0
GGUF loads through the Model Loader and stays within its error bar of the float file. The reference and control
images have other sizes and aspects than the video, so resizing and cropping are compared too.

Transformer calls: ComfyUI's own loader (``load_diffusion_model``, as UNETLoader) reads both tiny Fun files (the A14B
Control one and the 5B Control one on 48-channel latents, 148 input channels, a 48-channel ``ref_conv``) with its
model detection, in a subprocess inside the ComfyUI copy; one call with and one without a reference latent on
each give the outputs of WanMesh's loader within 1e-4.
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
                                   save_latent, saved)
from workflow_graph import load_workflow, node_of_type

from wanmesh.parallel.tiny.files import TINY_FILES
from wanmesh.parallel.tiny.fp8_write import write_fp8_file
from wanmesh.parallel.tiny.gguf_write import write_wan_gguf
from wanmesh.parallel.tiny.vae22 import NATIVE_VAE22_FILE, write_native_vae22
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
# Fun 5B Control: 48-channel latents at 16x (a 2 x 4 latent), with the reference image
MODEL_5B = Path(TINY_FILES["fun22_5b_control"]).name
WIDTH_5B, HEIGHT_5B = 64, 32
SAVED = ("ref_", "plain_", "kind_", "fiveb_", "vae22_")  # the prefixes of the saved latents' nodes
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


@pytest.fixture(scope="module")
def native_vae22(tiny_models_dir: Path) -> str:
    """The release-width Wan 2.2 VAE twin (native VAELoader builds every Wan 2.2 VAE at those widths) in the tree."""
    path = tiny_models_dir / NATIVE_VAE22_FILE
    if not path.is_file():
        write_native_vae22(tiny_models_dir)
    return path.name


def conditioning(reference: bool, vae: str = "vae", width: int = WIDTH, height: int = HEIGHT) -> dict[str, Any]:
    inputs = {"positive": ["pos", 0], "negative": ["neg", 0], "vae": [vae, 0], "width": width, "height": height,
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


def three_samplers(prompt: dict[str, Any], name: str, models: tuple[str, str, str], native: bool) -> None:
    """Nodes ``{name}_{side}`` save the latents of KSampler on the WanMesh MODEL, the WanMesh Sampler and (when
    ``native``) native KSampler on ``{name}_cond``; ``models``: the native MODEL, WanMesh MODEL and WanMesh model."""
    unet, wanmesh_model, wanmesh = models
    samplers = {"model": ksampler(wanmesh_model, f"{name}_cond"), "sampler": wanmesh_sampler(wanmesh, f"{name}_cond")}
    if native:
        samplers["native"] = ksampler(unet, f"{name}_cond")
    for side, node in samplers.items():
        prompt[f"{name}_{side}_k"] = node
        prompt[f"{name}_{side}"] = save_latent(f"{name}_{side}_k", f"fun22_{name}_{side}")


def vae22_twins(prompt: dict[str, Any], vae22: str) -> None:
    """Native VAEEncode / VAEDecode on VAELoader's Wan 2.2 VAE ``vae22`` beside WanMesh VAE Encode / Decode on the
    same file on the pool: ``vae22_{side}_enc`` saves the latent of the reference image at the 5B size,
    ``vae22_{side}_dec`` the native re-encoding of that (native) latent's decode."""
    prompt.update({
        "vae22_pixels": {"class_type": "ImageScale", "inputs": {"image": ["start", 0], "upscale_method": "bilinear",
                                                                "width": WIDTH_5B, "height": HEIGHT_5B, "crop": "center"}},
        "vae22_wvae": {"class_type": "WanMeshVAELoader", "inputs": {"vae_name": vae22, "dtype": "fp32",
                                                                    "pool": ["pool", 0]}},
        "vae22_n_enc": {"class_type": "VAEEncode", "inputs": {"pixels": ["vae22_pixels", 0], "vae": ["vae22", 0]}},
        "vae22_w_enc": {"class_type": "WanMeshVAEEncode", "inputs": {"pixels": ["vae22_pixels", 0],
                                                                     "vae": ["vae22_wvae", 0]}},
        "vae22_n_dec": {"class_type": "VAEDecode", "inputs": {"samples": ["vae22_n_enc", 0], "vae": ["vae22", 0]}},
        "vae22_w_dec": {"class_type": "WanMeshVAEDecode", "inputs": {"samples": ["vae22_n_enc", 0],
                                                                     "vae": ["vae22_wvae", 0]}},
    })
    for side, letter in (("native", "n"), ("wanmesh", "w")):
        prompt[f"vae22_{letter}_re"] = {"class_type": "VAEEncode", "inputs": {"pixels": [f"vae22_{letter}_dec", 0],
                                                                             "vae": ["vae22", 0]}}
        prompt[f"vae22_{side}_enc"] = save_latent(f"vae22_{letter}_enc", f"fun22_vae22_{side}_enc")
        prompt[f"vae22_{side}_dec"] = save_latent(f"vae22_{letter}_re", f"fun22_vae22_{side}_dec")


def fun22_prompt(layout: dict[str, Any], native: bool, kinds: dict[str, str] | None = None,
                 conditionings: tuple[str, ...] = CONDITIONINGS, vae22: str | None = None) -> dict[str, Any]:
    """Node ``{cond}_{side}`` saves the latent of one side of one conditioning (``native`` only when asked);
    ``kind_{name}`` the WanMesh Sampler's latent on a file kind, with the reference; ``fiveb_{side}`` Fun 5B
    Control's with the reference, on native VAELoader's Wan 2.2 VAE ``vae22`` (when given)."""
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
        three_samplers(prompt, name, ("unet", "wmodel", "wm"), native)
    if vae22:
        prompt.update({
            "vae22": {"class_type": "VAELoader", "inputs": {"vae_name": vae22}},
            "fiveb_cond": conditioning(True, "vae22", WIDTH_5B, HEIGHT_5B),
            "unet5b": {"class_type": "UNETLoader", "inputs": {"unet_name": MODEL_5B, "weight_dtype": "default"}},
            "wm5b": loader(MODEL_5B),
            "wmodel5b": {"class_type": "WanMeshNativeModel", "inputs": {"model": ["wm5b", 0]}},
        })
        three_samplers(prompt, "fiveb", ("unet5b", "wmodel5b", "wm5b"), native)
        if native:
            vae22_twins(prompt, vae22)
    for kind, model_file in (kinds or {}).items():
        prompt[f"kind_{kind}_wm"] = loader(model_file)
        prompt[f"kind_{kind}_k"] = wanmesh_sampler(f"kind_{kind}_wm", "ref_cond")
        prompt[f"kind_{kind}"] = save_latent(f"kind_{kind}_k", f"fun22_kind_{kind}")
    return prompt


@pytest.fixture(scope="module")
def latents(recent_comfyui_server: ComfyUIServer, file_kinds, native_vae22) -> dict[str, dict[str, torch.Tensor]]:
    results = {}
    for name, layout in LAYOUTS.items():
        world1 = name == "world1"
        # the parallel layouts run the reference conditioning only (its tokens are what the sequence split adds)
        prompt = fun22_prompt(layout, native=world1, kinds=file_kinds if world1 else None,
                              conditionings=CONDITIONINGS if world1 else ("ref",), vae22=native_vae22)
        result = run_successfully(recent_comfyui_server, prompt)
        nodes = [node for node in prompt if node.startswith(SAVED) and
                 prompt[node]["class_type"] == "SaveLatent"]
        results[name] = {node: saved(recent_comfyui_server, result, node) for node in nodes}
    return results


@pytest.mark.parametrize("cond, side", [(cond, side) for cond in CONDITIONINGS + ("fiveb",) for side in SIDES[1:]])
def test_wanmesh_equals_native_fun22_control(latents, cond: str, side: str) -> None:
    native, wanmesh = latents["world1"][f"{cond}_native"], latents["world1"][f"{cond}_{side}"]
    assert native.abs().max().item() > 0.1, "the native latent is flat: the comparison proves nothing"
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{cond} {side}: {difference:.3g} from native"


def test_the_reference_image_reaches_the_model(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["ref_native"], world1["plain_native"]) > 100 * TOLERANCE


@pytest.mark.parametrize("step", ["enc", "dec"])
def test_wanmesh_vae_nodes_equal_native_on_the_native_width_wan22_vae(latents, step: str) -> None:
    native, wanmesh = latents["world1"][f"vae22_native_{step}"], latents["world1"][f"vae22_wanmesh_{step}"]
    assert tuple(native.shape) == (1, 48, 1, HEIGHT_5B // 16, WIDTH_5B // 16) and native.std() > 0.05
    difference = largest_difference(native, wanmesh)
    assert difference <= TOLERANCE, f"{step}: {difference:.3g} from native"


def test_fun_5b_samples_48_channel_latents(latents) -> None:
    assert tuple(latents["world1"]["fiveb_native"].shape) == (1, 48, (LENGTH - 1) // 4 + 1, HEIGHT_5B // 16,
                                                              WIDTH_5B // 16)


def test_wanmesh_reads_the_native_width_wan22_vae(tiny_models_dir: Path, native_vae22: str) -> None:
    """The twin native VAELoader loaded above is a Wan 2.2 VAE to WanMesh too, at the release widths (its shapes
    only: building the 705M-parameter model here would add nothing the tiny file's VAE tests do not cover)."""
    from safetensors import safe_open

    from wanmesh.parallel.tiny.vae22 import NATIVE_VAE22_WIDTHS, TINY_VAE22
    from wanmesh.parallel.weights.vae22_keys import infer_wan22_vae_config, is_wan22_vae

    with safe_open(str(tiny_models_dir / NATIVE_VAE22_FILE), "pt") as opened:
        shapes = {key: tuple(opened.get_slice(key).get_shape()) for key in opened.keys()}
    assert is_wan22_vae(shapes)
    inferred = infer_wan22_vae_config(shapes)
    assert inferred == {key: {**TINY_VAE22, **NATIVE_VAE22_WIDTHS}[key] for key in inferred}


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
