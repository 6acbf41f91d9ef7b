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
from test_comfyui_server import assert_video, run_successfully, saved_video
from workflow_graph import load_workflow, node_of_type
from test_native_sampling import (LAYOUTS, MODEL_FILE, TEXT_ENCODER_FILE, TOLERANCE, largest_difference,
                                  pool_inputs, save_latent, saved)

LORA_A, LORA_B = "wan_native_lora_a.safetensors", "wan_native_lora_b.safetensors"
LORA_NAN, LORA_NO_MATCH = "wan_native_lora_nan.safetensors", "wan_native_lora_nomatch.safetensors"
LORA_OTHER_WIDTH = "wan_tiny_lora_comfy.safetensors"  # made for the tiny T2V model, whose layers are narrower
STRENGTHS = (0.8, -0.5)
PATCH_LAYOUTS = ("world1", "tp2", "ulysses2", "cfg_parallel2")
STEPS, CFG, SEED = 4, 5.0, 99
RANK = 4
# Guidance scales the float32 rounding of both passes; with the last block skipped in the unconditional pass the
# two models' latents were 1.6e-4 apart at cfg 5: the skip-layer comparison runs at cfg 2.
SLG_CFG = 2.0


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


def _ksampler(model: list, name: str, cfg: float = CFG) -> dict[str, dict[str, Any]]:
    return {f"k{name}": {"class_type": "KSampler", "inputs": {
        "model": model, "positive": ["pos", 0], "negative": ["neg", 0], "latent_image": ["latent", 0], "seed": SEED,
        "steps": STEPS, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}},
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
    """``n``/``w``/``m``: native, WanMesh MODEL and WanMesh LoRA Loader with the two LoRAs, ``ws`` the WanMesh
    MODEL under SkipLayerGuidanceDiTSimple; with patches also ``b`` (native without LoRA), ``ns`` (native skip
    layer guidance) and ``ne``/``we`` (EasyCache)."""
    prompt = base_prompt(layout)
    for side, start, node in (("n", ["unet", 0], "LoraLoaderModelOnly"), ("w", ["wmodel", 0], "LoraLoaderModelOnly"),
                              ("m", ["wm", 0], "WanMeshLoraLoader")):
        nodes, model = _lora_chain(start, side, node)
        prompt.update(nodes)
        if side == "m":
            prompt["mmodel"] = {"class_type": "WanMeshNativeModel", "inputs": {"model": model}}
            model = ["mmodel", 0]
        prompt.update(_ksampler(model, side))
    for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0]))[0 if with_patches else 1:]:
        prompt[f"{side}slg"] = {"class_type": "SkipLayerGuidanceDiTSimple", "inputs": {
            "model": model, "double_layers": "1", "single_layers": "", "start_percent": 0.0, "end_percent": 1.0}}
        prompt.update(_ksampler([f"{side}slg", 0], f"{side}s", cfg=SLG_CFG))
    if with_patches:
        prompt.update(_ksampler(["unet", 0], "b"))
        prompt.update(_ksampler(["unet", 0], "bs", cfg=SLG_CFG))
        for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0])):
            prompt[f"{side}ec"] = {"class_type": "EasyCache", "inputs": {
                "model": model, "reuse_threshold": 1.0, "start_percent": 0.0, "end_percent": 1.0, "verbose": True}}
            prompt.update(_ksampler([f"{side}ec", 0], f"{side}e"))
    return prompt


class LayoutLatents(dict):
    """{layout: {node: latent}}, each layout's prompt run when a test first asks for it."""

    def __init__(self, server: ComfyUIServer) -> None:
        super().__init__()
        self.server = server

    def __missing__(self, name: str) -> dict[str, torch.Tensor]:
        with_patches = name == "world1"
        result = run_successfully(self.server, patch_prompt(LAYOUTS[name], with_patches))
        nodes = ["n", "w", "m", "ws"] + (["b", "bs", "ns", "ne", "we"] if with_patches else [])
        self[name] = {node: saved(self.server, result, node) for node in nodes}
        return self[name]


@pytest.fixture(scope="module")
def latents(server: ComfyUIServer) -> LayoutLatents:
    return LayoutLatents(server)


def test_comfyui_lora_loaders_on_wanmesh_model_equal_native(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["n"], world1["b"]) > 100 * TOLERANCE, "the LoRAs change nothing: no proof"
    assert largest_difference(world1["n"], world1["w"]) <= TOLERANCE
    assert largest_difference(world1["n"], world1["m"]) <= TOLERANCE, "WanMesh LoRA Loader differs from native"


@pytest.mark.parametrize("layout", PATCH_LAYOUTS[1:])
def test_lora_loaders_in_parallel_layouts_equal_world1(latents, layout: str) -> None:
    for node in ("w", "m", "ws"):  # ws: skip layer guidance, the skipped block bypassed on every rank
        assert largest_difference(latents[layout][node], latents["world1"][node]) <= TOLERANCE, (layout, node)


def test_skip_layer_guidance_on_wanmesh_model_equals_native(latents) -> None:
    world1 = latents["world1"]
    assert largest_difference(world1["ns"], world1["bs"]) > 100 * TOLERANCE, "skipping a layer changes nothing"
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


@pytest.mark.parametrize("name", ["wan22_lightx2v", "t2v_easycache"])
def test_lora_and_easycache_workflows_run_as_api_prompts(server: ComfyUIServer, name: str) -> None:
    """The example workflows run and write their MP4; EasyCache's own log line says it skipped steps."""
    prompt = load_workflow(f"native/api/{name}.json")
    latent = node_of_type(prompt, "EmptyHunyuanLatentVideo")["inputs"]
    log_before = len(server.log())
    result = run_successfully(server, prompt)
    assert_video(saved_video(server, result, prompt), latent["length"], latent["width"], latent["height"])
    if name == "t2v_easycache":
        skipped = re.findall(r"EasyCache - skipped (\d+)/(\d+) steps", server.log()[log_before:])
        assert skipped and int(skipped[-1][0]) > 0, skipped


# -- every ComfyUI node that takes and returns MODEL ----------------------------------------------------------

WALK_STEPS, WALK_CFG = 1, 3.0
SPEED_ONLY = ("TorchCompileModel",)  # compiled natively would time the compiler: compared with the plain model
VERDICTS_FILE = Path(__file__).resolve().parents[2] / "build" / "test-output" / "model_patch_verdicts.md"
# the model patch table: the page that documents ComfyUI's MODEL nodes on the WanMesh MODEL
PATCH_TABLE_PAGE = Path(__file__).resolve().parents[2] / "docs" / "existing-workflow.md"
MAX_MESSAGE = 300


def _type_of(spec: list) -> str:
    kind = spec[0]
    return "COMBO" if isinstance(kind, list) else kind


def _default(spec: list) -> Any:
    kind, options = spec[0], (spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {})
    if isinstance(kind, list):
        return kind[0]
    if kind == "COMBO":
        return options["options"][0]
    if "default" in options:
        return options["default"]
    return {"INT": options.get("min", 0), "FLOAT": options.get("min", 0.0), "STRING": "", "BOOLEAN": False}[kind]


def model_nodes(info: dict[str, Any]) -> tuple[dict[str, dict], dict[str, str]]:
    """ComfyUI's own nodes (not custom nodes, not API nodes) that take and return MODEL: {name: inputs} of those
    whose other inputs are widgets, {name: the input type it needs} of the rest."""
    walked, unwalked = {}, {}
    for name, node in sorted(info.items()):
        module = node.get("python_module", "")
        if not (module == "nodes" or module.startswith("comfy_extras")) or "MODEL" not in node.get("output", []):
            continue
        required = node["input"].get("required", {})
        if not any(_type_of(spec) == "MODEL" for spec in required.values()):
            continue
        inputs, needs = {}, None
        for input_name, spec in required.items():
            kind = _type_of(spec)
            if kind == "MODEL":
                inputs[input_name] = None  # the model under test
            elif kind in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"):
                try:
                    inputs[input_name] = _default(spec)
                except (IndexError, KeyError):
                    needs = "file"  # a file list that is empty here (hypernetworks, model patches)
            else:
                needs = kind
        if needs is None:
            walked[name] = inputs
        else:
            unwalked[name] = needs
    return walked, unwalked


def walk_prompt(info: dict[str, Any], nodes: dict[str, dict]) -> dict[str, Any]:
    """``b``: the plain native model; per node i: ``na{i}`` native, ``wa{i}`` WanMesh, each through node i."""
    prompt = base_prompt(LAYOUTS["world1"])
    prompt["latent"]["inputs"].update(width=32, height=32, length=1)

    def sampler(model: list, name: str) -> None:
        prompt.update(_ksampler(model, name))
        prompt[f"k{name}"]["inputs"].update(steps=WALK_STEPS, cfg=WALK_CFG)

    sampler(["unet", 0], "b")
    sampler(["wmodel", 0], "wb")
    for index, (name, inputs) in enumerate(nodes.items()):
        output = info[name]["output"].index("MODEL")
        for side, model in (("n", ["unet", 0]), ("w", ["wmodel", 0])):
            if side == "n" and name in SPEED_ONLY:
                continue
            prompt[f"{side}p{index}"] = {"class_type": name, "inputs": {
                key: (model if value is None else value) for key, value in inputs.items()}}
            sampler([f"{side}p{index}", output], f"{side}a{index}")
    return prompt


def _branch_of(node_id: str) -> tuple[str, int] | None:
    """(side "n" or "w", node index) of a walked node or its sampler, None for a shared node."""
    match = re.fullmatch(r"k?([nw])[pa](\d+)", node_id)
    return (match.group(1), int(match.group(2))) if match else None


def _drop_branch(prompt: dict[str, Any], side: str, index: int) -> None:
    for node_id in (f"{side}p{index}", f"k{side}a{index}", f"{side}a{index}"):
        prompt.pop(node_id, None)


def test_every_comfyui_model_node_equals_native_or_is_refused_in_one_line(server: ComfyUIServer) -> None:
    """Each of ComfyUI's own MODEL -> MODEL nodes, with its default widgets, on both models: the WanMesh latent
    equals native within 1e-4, or the prompt stops at the WanMesh branch with a one-line message. A refused
    branch is removed and the prompt queued again (ComfyUI's cache keeps what already ran)."""
    info = server.get_json("/object_info")
    nodes, unwalked = model_nodes(info)
    names = list(nodes)
    assert "LoraLoaderModelOnly" in nodes and "EasyCache" in nodes, sorted(nodes)
    for name in ("LoraLoaderModelOnly",):  # its default LoRA file is whichever sorts first: use the native twin's
        nodes[name] = {**nodes[name], "lora_name": LORA_A}
    prompt = walk_prompt(info, nodes)
    errors: dict[tuple[str, int], tuple[str, str]] = {}  # (side, index) -> (exception type, message)
    for _ in range(len(nodes) * 2 + 1):
        result = server.run(prompt, 600)
        assert not isinstance(result, RejectedPrompt), result.error_text()
        if result.status == "success":
            break
        (error,) = [data for event, data in result.messages if event == "execution_error"]
        branch = _branch_of(error["node_id"])
        assert branch is not None, f"the prompt failed outside a walked branch: {error['exception_message']}"
        errors[branch] = (error["exception_type"], error["exception_message"].strip())
        _drop_branch(prompt, *branch)
    else:
        pytest.fail("the walk did not finish")
    verdicts: dict[str, str] = {}
    for (side, index), (kind, message) in sorted(errors.items()):
        if side == "n" or ("n", index) in errors:
            verdicts[names[index]] = f"fails natively on Wan too ({kind})"
            continue
        assert kind == "ValueError" and "\n" not in message and len(message) <= MAX_MESSAGE, (names[index], message)
        verdicts[names[index]] = f"refused: {message}"
    plain_native, plain_wanmesh = saved(server, result, "b"), saved(server, result, "wb")
    assert largest_difference(plain_native, plain_wanmesh) <= TOLERANCE
    differing = {}
    for index, name in enumerate(names):
        if name in verdicts:
            continue
        if f"na{index}" not in result.outputs and name not in SPEED_ONLY:
            # its native branch failed after its WanMesh one ran: a native failure on Wan
            verdicts[name] = "fails natively on Wan too"
            continue
        native = plain_native if name in SPEED_ONLY else saved(server, result, f"na{index}")
        # relative to the latent's size: a model sampling of the wrong kind for Wan (eps prediction, sigmas up to
        # 14.6) makes latents far larger than 1, and the float32 rounding of the prediction with them
        difference = largest_difference(native, saved(server, result, f"wa{index}"))
        if difference > TOLERANCE * max(1.0, native.abs().max().item()):
            differing[name] = difference
        changes = largest_difference(native, plain_native) > 100 * TOLERANCE
        verdicts[name] = ("accepted (the pool runs its own kernels)" if name in SPEED_ONLY
                          else f"equals native{' (changes the result)' if changes else ' (same result as without it here)'}")
    verdicts.update({name: f"not walked (needs a {kind} input)" for name, kind in unwalked.items()})
    VERDICTS_FILE.parent.mkdir(parents=True, exist_ok=True)
    VERDICTS_FILE.write_text("".join(f"| `{name}` | {verdict} |\n" for name, verdict in sorted(verdicts.items())))
    assert not differing, f"WanMesh MODEL differs from native (and is not refused): {differing}"
    page = PATCH_TABLE_PAGE.read_text(encoding="utf-8")
    missing = [name for name in verdicts if f"`{name}`" not in page]
    assert not missing, f"docs/existing-workflow.md's model patch table lacks {missing} (see {VERDICTS_FILE})"
