"""Every model-file kind through every user path, compared with the float file: the end-to-end matrix.

Runs in the test process; the kinds (``tests/model_kinds.py``: fp32/fp16/bf16, fp8 e4m3fn/e5m2, scaled fp8,
prefixed keys, the diffusers folder, GGUF of every tensor type and a mixed Q4_K_M) are written from the tiny T2V
into the session's models tree, which the ComfyUI server of this module serves.

* Command line: ``wanmesh generate --model KIND`` for every kind (32x32, 5 frames, 2 steps, world 1, latents saved),
  plus ``--weights dequantize``, quantized files as ``--model-low`` and ``--vace-module``, ``--lora`` on quantized
  models and ``wanmesh stream`` on quantized files, all through the command's ``main`` in this process with one
  worker pool shared by the runs (``SharedPool``: a run that starts and stops its own pool costs seconds); the issue's
  command and a stream also run as a user runs them (fresh interpreters, own pools) and must give the same latents.
* The Model Loader node on the real ComfyUI server: one API prompt holds a loader and a sampler per kind and weights
  mode (keep, dequantize), LoRAs on quantized models, quantized VACE modules and the file of the unet-only folder,
  each sampler's latent saved by ``SaveLatent``; a second prompt on a tp 2 pool runs the representative kinds, which
  must give the one-rank latents; each bad file is a one-line node error and the server keeps serving. The command
  line and the node give the same latents for the same graph. The 2024 ComfyUI lists every kind (its transformer
  folders are ``unet`` plus ``diffusion_models``) and runs the representative ones as the recent one does.

Compute dtypes: the representative kinds also run in bf16 (and the float file in fp16), through the command line
(``--dtype``), the Model Loader on one rank and on the tp 2 pool; each within ``COMPUTE_BARS`` of the same file
computed in fp32 (and differing from it: the dtype reached the ranks), tp 2 within ``COMPUTE_TP_BARS`` of one rank
in the same dtype.

Each kind's latents stay within its error bar of the float file's (``model_kinds``: exact for the same float32
weights, close for fp16/bf16, fp8 and Q8_0, looser for 5 bits, loosest for 4 bits and fewer); another seed lands
far outside every bar, so the comparison can fail.
"""

from __future__ import annotations

import contextlib
import io
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_runs import run_cli
from comfyui_server import UNET_ONLY_FOLDER, ComfyUIServer, PromptResult
from model_kinds import (BAD_MODEL_FILES, BAD_FOLDER, FLOAT_KIND, KINDS, SCALES_WITHOUT_MARKER, VACE_MODULE_KINDS,
                         WrittenKinds, relative_error, vace_module_file, write_bad_model_files, write_model_kinds,
                         write_vace_module_kinds)
from safetensors.torch import load_file
from test_comfyui_server import SINGLE_RANK_POOL, run_successfully
from workflow_builder import WorkflowBuilder

pytestmark = pytest.mark.timeout(900)

PROMPT, NEGATIVE = "a red fox running through snow", "blurry, low quality"
SEED, STEPS, SHIFT, CFG = 5, 2, 3.0, 5.0
WIDTH = HEIGHT = 32
FRAMES = 5
TP_TOLERANCE = 1e-4  # tp 2 against one rank, largest latent difference (as the other tensor-parallel tests)
SAME_WEIGHTS = 1e-6  # keep against dequantize: the same dequantizer, so the same weights
LORA = ("wan_tiny_lora_comfy.safetensors", 0.8)
# tp 2 == one rank on these (the server's tp 2 pool): float, scaled fp8, GGUF block and K-quant, the mixed file.
TP2_KINDS = ("bf16", "fp8_scaled", "gguf_Q8_0", "gguf_Q4_K", "gguf_Q4_K_M")
QUANTIZED_FOR_PATHS = ("fp8_scaled", "gguf_Q8_0")  # the quantized kinds a LoRA is applied to
CLI_DEQUANTIZE = ("fp8_scaled", "gguf_Q4_K_M", "bf16")  # --weights dequantize on the command line (the node: every kind)
# bf16 / fp16 files computed in float32 (the CPU's auto): "keep" holds them as stored, widened per layer
NARROW_KINDS = ("fp16", "bf16")
STREAM_KINDS = ("fp8_scaled", "gguf_Q4_K")
TWO_EXPERTS = ("fp8_e4m3fn", "gguf_Q4_0")  # --model, --model-low
CROSS_ROUTE = 1e-5  # the same graph through the command line and through the node, or in and out of process
UNET_ONLY_FILE = "wan_tiny_t2v_unet_only_Q8_0.gguf"
# Compute dtypes (--dtype, the loader's dtype): relative error bars against the same file computed in fp32, and of
# tp 2 against one rank in the same dtype. Measured here: bf16 about 1e-2, fp16 1.5e-3; tp 2 in bf16 below 1e-2.
COMPUTE_CASES = (("bf16", "bf16"), ("fp8_scaled", "bf16"), ("gguf_Q8_0", "bf16"), ("fp32", "fp16"))
COMPUTE_BARS = {"bf16": 0.05, "fp16": 0.01}
COMPUTE_TP_BARS = {"bf16": 0.03, "fp16": 0.006}
HALF_DIFFERS = 1e-4  # a half-precision run differs from fp32 at least this much: the dtype reached the ranks


@pytest.fixture(scope="module")
def kinds(tiny_models_dir: Path) -> WrittenKinds:
    """Every kind, the quantized VACE modules, the bad files and a copy of the Q8_0 in the unet-only folder, in the
    session's models tree (before this module's server starts)."""
    started = time.monotonic()
    float_file = tiny_models_dir / "diffusion_models" / "wan_tiny_t2v.safetensors"
    written = write_model_kinds(tiny_models_dir, float_file)
    write_vace_module_kinds(tiny_models_dir, tiny_models_dir / "diffusion_models" / "wan_tiny_vace_module.safetensors")
    write_bad_model_files(tiny_models_dir, float_file)
    (tiny_models_dir / UNET_ONLY_FOLDER).mkdir(exist_ok=True)
    (tiny_models_dir / UNET_ONLY_FOLDER / UNET_ONLY_FILE).write_bytes(written.path("gguf_Q8_0").read_bytes())
    print(f"\nmodel kinds written in {time.monotonic() - started:.1f} s")
    return written


# == the command line =========================================================================================

def _files(tree: Path) -> list[str]:
    return ["--vae", str(tree / "vae/wan_tiny_vae.safetensors"),
            "--text-encoder", str(tree / "text_encoders/umt5_tiny.safetensors")]


SIZE = ["--width", str(WIDTH), "--height", str(HEIGHT), "--frames", str(FRAMES), "--steps", str(STEPS),
        "--seed", str(SEED), "--device", "cpu"]


def _generate(tree: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return ["generate", "--prompt", PROMPT, "--negative", NEGATIVE, "--model", str(model), *_files(tree), *SIZE,
            "--shift", str(SHIFT), "--cfg", str(CFG), "--sampler", "wan_unipc", "--out", str(out / "video.mp4"),
            "--save-latents", str(out / "latents.safetensors"), *extra]


def _stream(tree: Path, out: Path, model: Path, *extra: str) -> list[str]:
    return ["stream", "--prompt", PROMPT, "--model", str(model), *_files(tree), *SIZE, "--chunk", "1",
            "--out", str(out / "video.mp4"), "--chunk-dir", str(out / "chunks"),
            "--save-latents", str(out / "latents.safetensors"), *extra]


def _cli_commands(kinds: WrittenKinds) -> dict[str, Any]:
    """{run name: function(output folder) -> argv}: every written kind, then the other paths."""
    tree = kinds.root
    modules = {"float": tree / "diffusion_models/wan_tiny_vace_module.safetensors",
               **{name: tree / vace_module_file(name) for name in VACE_MODULE_KINDS}}
    lora = ["--lora", f"{tree / 'loras' / LORA[0]}:{LORA[1]}"]
    commands = {f"{name}:keep": (lambda out, name=name: _generate(tree, out, kinds.path(name)))
                for name in KINDS}
    commands.update({f"{name}:keep:{dtype}": (lambda out, name=name, dtype=dtype: _generate(
        tree, out, kinds.path(name), "--dtype", dtype)) for name, dtype in COMPUTE_CASES})
    commands.update({
        f"{name}:dequantize": (lambda out, name=name: _generate(tree, out, kinds.path(name), "--weights", "dequantize"))
        for name in CLI_DEQUANTIZE})
    commands.update({f"vace:{name}": (lambda out, module=module: _generate(
        tree, out, kinds.path(FLOAT_KIND), "--vace-module", str(module))) for name, module in modules.items()})
    commands.update({f"lora:{name}": (lambda out, name=name: _generate(tree, out, kinds.path(name), *lora))
                     for name in (FLOAT_KIND, *QUANTIZED_FOR_PATHS)})
    commands.update({f"stream:{name}": (lambda out, name=name: _stream(tree, out, kinds.path(name)))
                     for name in (FLOAT_KIND, *STREAM_KINDS)})
    commands["two_experts"] = lambda out: _generate(tree, out, kinds.path(TWO_EXPERTS[0]), "--model-low",
                                                    str(kinds.path(TWO_EXPERTS[1])))
    return commands


class SharedPool:
    """Stands in for ``WorkerPool`` in the command's modules: every run gets the one pool (started once, closed by
    the fixture) instead of starting and stopping its own; everything else is the command's own code."""

    def __init__(self, pool):
        self.pool = pool

    def __call__(self, config):
        assert (config.world, config.tp, config.ulysses) == (1, 1, 1), config
        return self

    def __enter__(self):
        return self.pool

    def __exit__(self, *exc_info):
        return False


@pytest.fixture(scope="module")
def cli(kinds: WrittenKinds, tmp_path_factory) -> dict[str, dict]:
    """Every command line run once through ``wanmesh.parallel.cli.main`` in this process, all on one one-rank pool;
    each result: exit code, stderr, stdout and the saved latents."""
    from wanmesh.parallel.cli import generate, main, stream
    from wanmesh.parallel.config import ParallelConfig
    from wanmesh.parallel.driver.pool import WorkerPool

    workdir, results = tmp_path_factory.mktemp("cli_kinds"), {}
    started = time.monotonic()
    with WorkerPool(ParallelConfig(world=1, devices="cpu")) as pool, pytest.MonkeyPatch.context() as patch:
        for module in (generate, stream):
            patch.setattr(module, "WorkerPool", SharedPool(pool))
        for name, command in _cli_commands(kinds).items():
            out = workdir / name.replace(":", "_")
            out.mkdir()
            stdout, stderr = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                code = main(command(out))
            results[name] = {"code": code, "stderr": stderr.getvalue(), "stdout": stdout.getvalue(),
                             "latents": _saved_latents(out, code)}
    print(f"\n{len(results)} command lines in one process in {time.monotonic() - started:.1f} s")
    return results


def _saved_latents(out: Path, code: int) -> torch.Tensor | None:
    """What ``--save-latents`` wrote into ``out`` (None when the run failed)."""
    saved = out / "latents.safetensors"
    return load_file(str(saved))["latents"] if code == 0 and saved.is_file() else None


def _latents(results: dict[str, dict], name: str) -> torch.Tensor:
    result = results[name]
    assert result["code"] == 0 and result["latents"] is not None, f"{name}: {result['stderr']}"
    return result["latents"]


@pytest.mark.parametrize("name", list(KINDS))
def test_generate_runs_every_kind_close_to_the_float_file(kinds, cli, name):
    error = relative_error(_latents(cli, f"{name}:keep"), _latents(cli, f"{FLOAT_KIND}:keep"))
    print(f"wanmesh generate --model {name}: relative error {error:.3g} (bar {KINDS[name].bar})")
    assert error <= KINDS[name].bar, f"{name}: relative error {error:.3g} over its bar {KINDS[name].bar}"


def _check_compute_dtype(results: dict, name: str, dtype: str) -> None:
    """The file computed in ``dtype`` against the same file in fp32: within the dtype's bar, and not equal."""
    error = relative_error(results[f"{name}:keep:{dtype}"], results[f"{name}:keep"])
    print(f"{name} computed in {dtype}: relative error {error:.3g} against fp32 (bar {COMPUTE_BARS[dtype]})")
    assert HALF_DIFFERS < error <= COMPUTE_BARS[dtype], f"{name} in {dtype}: relative error {error:.3g} to fp32"


@pytest.mark.parametrize("name, dtype", COMPUTE_CASES)
def test_generate_computes_in_the_given_dtype(kinds, cli, name, dtype):
    latents = {case: _latents(cli, case) for case in (f"{name}:keep", f"{name}:keep:{dtype}")}
    _check_compute_dtype(latents, name, dtype)
    assert f"compute dtype {dtype}" in cli[f"{name}:keep:{dtype}"]["stderr"]


def test_the_plan_line_names_the_type_holding_most_weights(kinds, cli):
    """A scaled-fp8 file holds more bf16 norms than fp8 matrices, but nearly all its bytes are fp8."""
    assert "F8_E4M3 file, kept quantized, compute dtype bf16" in cli["fp8_scaled:keep:bf16"]["stderr"]
    assert "Q8_0 file, kept quantized, compute dtype bf16" in cli["gguf_Q8_0:keep:bf16"]["stderr"]


@pytest.mark.parametrize("name", CLI_DEQUANTIZE)
def test_generate_weights_dequantize_gives_the_kept_weights_result(kinds, cli, name):
    difference = (_latents(cli, f"{name}:keep") - _latents(cli, f"{name}:dequantize")).abs().max()
    assert difference <= SAME_WEIGHTS, f"{name}: --weights keep and dequantize differ by {difference:.3g}"


def test_generate_takes_quantized_files_as_both_experts(kinds, cli):
    """Two experts holding the same weights sample as one model: plain fp8 high, Q4_0 low, against the float file."""
    error = relative_error(_latents(cli, "two_experts"), _latents(cli, f"{FLOAT_KIND}:keep"))
    bar = max(KINDS[name].bar for name in TWO_EXPERTS)
    assert error <= bar, f"relative error {error:.3g} over {bar}"
    assert "high-noise expert: step 0, low-noise expert: step 1" in cli["two_experts"]["stderr"]


@pytest.mark.parametrize("name", VACE_MODULE_KINDS)
def test_generate_takes_a_quantized_vace_module(kinds, cli, name):
    error = relative_error(_latents(cli, f"vace:{name}"), _latents(cli, "vace:float"))
    assert error <= KINDS[name].bar, f"{name} VACE module: relative error {error:.3g}"


@pytest.mark.parametrize("name", QUANTIZED_FOR_PATHS)
def test_generate_applies_a_lora_to_a_quantized_model(kinds, cli, name):
    with_lora = _latents(cli, f"lora:{FLOAT_KIND}")
    error = relative_error(_latents(cli, f"lora:{name}"), with_lora)
    assert error <= KINDS[name].bar, f"{name} + LoRA: relative error {error:.3g}"
    effect = relative_error(_latents(cli, f"{FLOAT_KIND}:keep"), with_lora)
    assert effect > 4 * error, f"the LoRA changes the float latents by {effect:.3g}: too little to tell it applied"


@pytest.mark.parametrize("name", STREAM_KINDS)
def test_stream_runs_quantized_files(kinds, cli, name):
    error = relative_error(_latents(cli, f"stream:{name}"), _latents(cli, f"stream:{FLOAT_KIND}"))
    assert error <= KINDS[name].bar, f"{name}: relative error {error:.3g}"
    assert "chunk 1:" in cli[f"stream:{name}"]["stdout"]


@pytest.fixture(scope="module")
def cli_as_a_user_runs_it(kinds: WrittenKinds, tmp_path_factory) -> dict[str, dict]:
    """The issue's command and a stream on a quantized file, each in a fresh interpreter with its own pool."""
    workdir = tmp_path_factory.mktemp("cli_subprocess")
    commands = {"generate": lambda out: _generate(kinds.root, out, kinds.path("gguf_Q8_0")),
                "stream": lambda out: _stream(kinds.root, out, kinds.path("fp8_scaled"))}

    def run(item):
        name, command = item
        out = workdir / name
        out.mkdir()
        result = run_cli(command(out), out)
        return name, {**result, "latents": _saved_latents(out, result["code"])}

    with ThreadPoolExecutor(max_workers=2) as threads:
        return dict(threads.map(run, commands.items()))


def test_the_commands_as_a_user_runs_them_give_the_same_latents(cli, cli_as_a_user_runs_it):
    for name, in_process in (("generate", "gguf_Q8_0:keep"), ("stream", "stream:fp8_scaled")):
        result = cli_as_a_user_runs_it[name]
        assert result["code"] == 0 and result["pool_started"], result["stderr"]
        difference = (_latents(cli_as_a_user_runs_it, name) - _latents(cli, in_process)).abs().max()
        assert difference <= CROSS_ROUTE, f"{name}: {difference:.3g} from the same command run in process"


# == the Model Loader on a real ComfyUI server ================================================================

class Graph:
    """An API prompt built on the server's node definitions: shared text, latent and pool, then one loader,
    sampler and SaveLatent per case; ``cases`` maps a case name to its SaveLatent node id."""

    def __init__(self, info: dict[str, Any], pool: dict[str, Any], seed: int = SEED):
        self.w, self.seed, self.cases = WorkflowBuilder(info, upload_in_prompt=False), seed, {}
        self.pool = self.w.node("WanMeshPool", [0, 0], {**pool, "backend": "local", "ray_address": ""})
        self.text_by_dtype: dict[str, list] = {}
        self.latent = self.w.node("WanMeshEmptyLatent", [0, 0], {"width": WIDTH, "height": HEIGHT, "length": FRAMES,
                                                                 "batch_size": 1})

    def texts(self, dtype: str) -> list:
        """The prompt and negative prompt encoded by the text encoder in ``dtype`` (as ``--dtype`` loads it)."""
        if dtype not in self.text_by_dtype:
            encoder = self.w.node("WanMeshTextEncoderLoader", [0, 0], {"text_encoder_name": "umt5_tiny.safetensors",
                                                                       "dtype": dtype}, {"pool": (self.pool, 0)})
            self.text_by_dtype[dtype] = [self.w.node("WanMeshTextEncode", [0, 0], {"text": text},
                                                     {"text_encoder": (encoder, 0)}) for text in (PROMPT, NEGATIVE)]
        return self.text_by_dtype[dtype]

    def add(self, case: str, model_name: str, weights: str = "keep", vace_module: str = "none",
            lora: tuple[str, float] | None = None, seed: int | None = None, dtype: str = "auto") -> None:
        model = self.w.node("WanMeshModelLoader", [0, 0], {"model_name": model_name, "dtype": dtype,
                                                           "vace_module": vace_module, "weights": weights},
                            {"pool": (self.pool, 0)})
        if lora is not None:
            model = self.w.node("WanMeshLoraLoader", [0, 0], {"lora_name": lora[0], "strength": lora[1]},
                                {"model": (model, 0)})
        sampled = self.w.node("WanMeshSampler", [0, 0], {
            "seed": self.seed if seed is None else seed, "steps": STEPS, "cfg": CFG, "shift": SHIFT,
            "sampler_name": "unipc", "denoise": 1.0}, {"model": (model, 0), "positive": (self.texts(dtype)[0], 0),
                                                      "negative": (self.texts(dtype)[1], 0),
                                                      "latent_image": (self.latent, 0)})
        self.cases[case] = str(self.w.node("SaveLatent", [0, 0], {"filename_prefix": f"kinds/{case}"},
                                           {"samples": (sampled, 0)}))

    def run(self, server: ComfyUIServer, what: str = "") -> dict[str, torch.Tensor]:
        """Run the prompt (its time printed under ``what``); each case's latents."""
        started = time.monotonic()
        result = run_successfully(server, self.w.api())
        if what:
            print(f"\n{what}: {len(self.cases)} loaders and samplers in one prompt, {time.monotonic() - started:.1f} s")
        return {case: _saved_latent(server, result, node_id) for case, node_id in self.cases.items()}


def _saved_latent(server: ComfyUIServer, result: PromptResult, node_id: str) -> torch.Tensor:
    (item,) = result.outputs[node_id]["latents"]
    return load_file(str(server.output_dir / item["subfolder"] / item["filename"]))["latent_tensor"]


def _held_as_stored(name: str) -> bool:
    """Whether "keep" holds the file's bytes and "dequantize" expands them (quantized, or narrower than fp32)."""
    return KINDS[name].quantized or name in NARROW_KINDS


def _modes(name: str) -> tuple[str, ...]:
    return ("keep", "dequantize") if _held_as_stored(name) else ("keep",)


@pytest.fixture(scope="module")
def info(kinds, recent_comfyui_server: ComfyUIServer) -> dict[str, Any]:
    return recent_comfyui_server.get_json("/object_info")


@pytest.fixture(scope="module")
def node_matrix(kinds: WrittenKinds, recent_comfyui_server: ComfyUIServer, info) -> dict[str, torch.Tensor]:
    """One prompt on one rank: every kind in each weights mode, LoRAs and VACE modules on quantized files, the file
    in the unet-only folder, scales without the marker, and the float file at another seed."""
    graph = Graph(info, SINGLE_RANK_POOL)
    for name in KINDS:
        for mode in _modes(name):
            graph.add(f"{name}:{mode}", kinds.comfy_name(name), mode)
    float_name = kinds.comfy_name(FLOAT_KIND)
    graph.add("other_seed", float_name, seed=SEED + 1)
    for name, dtype in COMPUTE_CASES:
        graph.add(f"{name}:keep:{dtype}", kinds.comfy_name(name), dtype=dtype)
    graph.add("unet_only", UNET_ONLY_FILE)
    graph.add("scales_without_marker", SCALES_WITHOUT_MARKER.removeprefix("diffusion_models/"))
    for name in (FLOAT_KIND, *QUANTIZED_FOR_PATHS):
        graph.add(f"lora:{name}", kinds.comfy_name(name), lora=LORA)
    graph.add("vace:float", float_name, vace_module="wan_tiny_vace_module.safetensors")
    for name in VACE_MODULE_KINDS:
        graph.add(f"vace:{name}", float_name, vace_module=vace_module_file(name).removeprefix("diffusion_models/"))
    return graph.run(recent_comfyui_server, "one rank")


def test_the_model_loader_lists_every_kind(kinds, info):
    listed = info["WanMeshModelLoader"]["input"]["required"]["model_name"][0]
    expected = [kinds.comfy_name(name) for name in KINDS]
    missing = [name for name in [*expected, UNET_ONLY_FILE] if name not in listed]
    assert not missing, f"not in the Model Loader's list: {missing}"
    modules = info["WanMeshModelLoader"]["input"]["optional"]["vace_module"][0]
    assert {vace_module_file(name).removeprefix("diffusion_models/") for name in VACE_MODULE_KINDS} <= set(modules)


@pytest.mark.parametrize("name", list(KINDS))
def test_the_model_loader_runs_every_kind_close_to_the_float_file(kinds, node_matrix, name):
    reference = node_matrix[f"{FLOAT_KIND}:keep"]
    for mode in _modes(name):
        error = relative_error(node_matrix[f"{name}:{mode}"], reference)
        print(f"Model Loader {name} weights={mode}: relative error {error:.3g} (bar {KINDS[name].bar})")
        assert error <= KINDS[name].bar, f"{name} ({mode}): relative error {error:.3g} over {KINDS[name].bar}"
    if _held_as_stored(name):
        difference = (node_matrix[f"{name}:keep"] - node_matrix[f"{name}:dequantize"]).abs().max()
        assert difference <= SAME_WEIGHTS, f"{name}: keep and dequantize differ by {difference:.3g}"


def test_another_seed_lands_far_outside_every_bar(node_matrix):
    error = relative_error(node_matrix["other_seed"], node_matrix[f"{FLOAT_KIND}:keep"])
    assert error > 2 * max(kind.bar for kind in KINDS.values()), f"another seed differs by only {error:.3g}"


def test_a_file_in_the_unet_folder_and_scales_without_the_marker_load(node_matrix):
    assert torch.equal(node_matrix["unet_only"], node_matrix["gguf_Q8_0:keep"])
    assert torch.equal(node_matrix["scales_without_marker"], node_matrix["fp8_scaled:keep"])


@pytest.mark.parametrize("name, dtype", COMPUTE_CASES)
def test_the_model_loader_computes_in_the_given_dtype(node_matrix, name, dtype):
    _check_compute_dtype(node_matrix, name, dtype)


@pytest.mark.parametrize("name", QUANTIZED_FOR_PATHS)
def test_the_lora_loader_applies_to_quantized_models(node_matrix, name):
    error = relative_error(node_matrix[f"lora:{name}"], node_matrix[f"lora:{FLOAT_KIND}"])
    assert error <= KINDS[name].bar, f"{name} + LoRA: relative error {error:.3g}"
    effect = relative_error(node_matrix[f"lora:{FLOAT_KIND}"], node_matrix[f"{FLOAT_KIND}:keep"])
    assert effect > 4 * error, f"the LoRA changes the float latents by {effect:.3g}: too little to tell it applied"


@pytest.mark.parametrize("name", VACE_MODULE_KINDS)
def test_the_model_loader_takes_quantized_vace_modules(node_matrix, name):
    error = relative_error(node_matrix[f"vace:{name}"], node_matrix["vace:float"])
    assert error <= KINDS[name].bar, f"{name} VACE module: relative error {error:.3g}"


@pytest.mark.parametrize("name", list(BAD_MODEL_FILES))
def test_a_bad_file_is_a_one_line_node_error_and_the_server_keeps_serving(kinds, node_matrix, recent_comfyui_server,
                                                                         info, name):
    file, message = BAD_MODEL_FILES[name]
    model_name = f"{BAD_FOLDER.removeprefix('diffusion_models/')}/{file}"
    graph = Graph(info, SINGLE_RANK_POOL)
    graph.add("bad", model_name)
    result = recent_comfyui_server.run(graph.w.api(), 120.0)
    assert isinstance(result, PromptResult) and result.status == "error", f"{name} was accepted"
    (error,) = [data for event, data in result.messages if event == "execution_error"]
    assert error["node_type"] == "WanMeshModelLoader"
    assert error["exception_message"].strip().startswith(f"model_name {model_name}:"), error["exception_message"]
    assert message in error["exception_message"] and "\n" not in error["exception_message"].strip()
    again = Graph(info, SINGLE_RANK_POOL, seed=SEED + 2)
    again.add("again", kinds.comfy_name("gguf_Q8_0"))
    again.run(recent_comfyui_server)


def test_generate_and_the_model_loader_give_the_same_latents(cli, node_matrix):
    """The same graph (kind, weights mode, VACE module, LoRA) through the command line and through the node."""
    shared = sorted(cli.keys() & node_matrix.keys())
    only_cli = {name for name in cli.keys() - node_matrix.keys() if not name.startswith("stream:")}
    assert only_cli == {"two_experts"}, f"cases the node matrix lacks: {only_cli}"
    differing = {name: float((_latents(cli, name) - node_matrix[name]).abs().max()) for name in shared}
    assert all(value <= CROSS_ROUTE for value in differing.values()), differing


@pytest.fixture(scope="module")
def node_tp2(kinds: WrittenKinds, node_matrix, recent_comfyui_server: ComfyUIServer, info) -> dict[str, torch.Tensor]:
    """The representative kinds on a tp 2 pool (one prompt)."""
    graph = Graph(info, {**SINGLE_RANK_POOL, "devices": "cpu:2", "world": 2, "tp": 2})
    for name in TP2_KINDS:
        graph.add(name, kinds.comfy_name(name))
    for name, dtype in COMPUTE_CASES:
        graph.add(f"{name}:keep:{dtype}", kinds.comfy_name(name), dtype=dtype)
    return graph.run(recent_comfyui_server, "tp 2")


@pytest.mark.parametrize("name", TP2_KINDS)
def test_tp2_gives_the_one_rank_latents(kinds, node_matrix, node_tp2, name):
    difference = (node_tp2[name] - node_matrix[f"{name}:keep"]).abs().max()
    assert difference <= TP_TOLERANCE, f"{name}: tp 2 differs from one rank by {difference:.3g}"


@pytest.mark.parametrize("name, dtype", COMPUTE_CASES)
def test_tp2_in_half_precision_is_close_to_one_rank(node_matrix, node_tp2, name, dtype):
    case = f"{name}:keep:{dtype}"
    error = relative_error(node_tp2[case], node_matrix[case])
    assert error <= COMPUTE_TP_BARS[dtype], f"{case}: tp 2 differs from one rank by {error:.3g}"


# == the 2024 ComfyUI =========================================================================================

@pytest.fixture(scope="module")
def node_2024(kinds: WrittenKinds, comfyui_server: ComfyUIServer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The 2024 server's node definitions, and the representative kinds and the unet-only file run on one rank."""
    info = comfyui_server.get_json("/object_info")
    graph = Graph(info, SINGLE_RANK_POOL)
    for name in TP2_KINDS:
        graph.add(f"{name}:keep", kinds.comfy_name(name))
    graph.add("unet_only", UNET_ONLY_FILE)
    return info, graph.run(comfyui_server, "2024 ComfyUI, one rank")


def test_the_2024_comfyui_lists_the_kinds_and_runs_them_as_the_recent_one(kinds, node_matrix, node_2024):
    """A 2024 ComfyUI knows the transformer folders as ``unet`` (plus ``diffusion_models`` from the extra paths):
    the loader lists the files of both, and the same graph gives the recent server's latents."""
    info, latents = node_2024
    listed = info["WanMeshModelLoader"]["input"]["required"]["model_name"][0]
    missing = [name for name in [*map(kinds.comfy_name, KINDS), UNET_ONLY_FILE]
               if name not in listed]
    assert not missing, f"not in the 2024 Model Loader's list: {missing}"
    differing = {name: float((value - node_matrix[name]).abs().max()) for name, value in latents.items()}
    assert all(value <= CROSS_ROUTE for value in differing.values()), differing
