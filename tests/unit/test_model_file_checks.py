"""The pre-flight model-file checks on every file kind, in process (no workers): each kind passes and gives its head
count from its own header (GGUF included); a foreign, truncated or unsupported GGUF and a scaled-fp8 file missing a
scale are refused with one line naming the file, through every flag of ``wanmesh generate`` and ``wanmesh stream``
(exit 2, no worker pool) and through the Model Loader node; the node lists and finds .gguf files in both
``diffusion_models`` and ``unet`` folders, as a 2024 and a recent ComfyUI lay them out."""

from __future__ import annotations

import shutil
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model_kinds import BAD_MODEL_FILES, KINDS, WrittenKinds, write_bad_model_files, write_model_kinds
from wanmesh.parallel.cli import main
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.validation import check_model_file
from wanmesh.parallel.weights.detect import UNSUPPORTED_FAMILIES, detect_kind

QUICK = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "1", "--device", "cpu"]


@dataclass(frozen=True)
class Tree:
    root: Path
    written: WrittenKinds
    bad: dict[str, Path]

    def __truediv__(self, relative: str) -> Path:
        return self.root / relative


@pytest.fixture(scope="module")
def tree(tiny_models, tmp_path_factory) -> Tree:
    """A copy of the tiny models tree with every kind and the bad files written into it."""
    root = tmp_path_factory.mktemp("kinds_tree")
    shutil.copytree(Path(tiny_models["t2v"]).parents[1], root, dirs_exist_ok=True)
    float_file = root / "diffusion_models" / "wan_tiny_t2v.safetensors"
    return Tree(root, write_model_kinds(root, float_file), write_bad_model_files(root, float_file))


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_passes_and_its_header_gives_the_head_count(tree, name):
    path = tree.written.path(name)
    check_model_file(path, "model", "--model", ParallelConfig(world=4, tp=2, ulysses=2, devices="cpu"))
    with pytest.raises(ValueError, match=r"^tp=3 does not divide the model's 4 attention heads"):
        check_model_file(path, "model", "--model", ParallelConfig(world=3, tp=3, devices="cpu"))


def test_scales_without_the_marker_are_fine(tree):
    check_model_file(tree.bad["scales_without_marker"], "model", "--model")


@pytest.fixture()
def no_pool(monkeypatch):
    """Fail the test if a worker pool starts: the checks must come first."""
    from wanmesh.parallel.cli import generate, stream

    def refuse(*args, **kwargs):
        raise AssertionError("a worker pool was started for input a static check can refuse")

    for module in (generate, stream):
        monkeypatch.setattr(module, "WorkerPool", refuse)


def _command(tree: Tree, entry: str, bad: Path, tmp_path: Path) -> list[str]:
    models = {"--vae": tree / "vae/wan_tiny_vae.safetensors",
              "--text-encoder": tree / "text_encoders/umt5_tiny.safetensors",
              "--model": tree / "diffusion_models/wan_tiny_t2v.safetensors"}
    command, flag = entry.split()
    models[flag] = bad if flag == "--model" else models["--model"]
    extra = [] if flag == "--model" else [flag, str(bad)]
    args = [command, "--prompt", "a fox", "--out", str(tmp_path / "out.mp4"), *QUICK,
            *(item for key, path in models.items() for item in (key, str(path))), *extra]
    if command == "stream":
        args += ["--chunk-dir", str(tmp_path / "chunks")]
    return args


ENTRIES = ["generate --model", "generate --model-low", "generate --vace-module", "stream --model"]
# A VACE module's kind check comes first: a T2V-shaped file is refused as not a module, so only the GGUF read and
# architecture checks are asked of --vace-module.
CASES = [(entry, name) for entry in ENTRIES for name in BAD_MODEL_FILES
         if entry != "generate --vace-module" or name.startswith("gguf_") and name != "gguf_unsupported_type"]


@pytest.mark.parametrize("entry, name", CASES, ids=[f"{e.replace(' --', '-')}-{n}" for e, n in CASES])
def test_a_bad_model_file_exits_2_with_one_line_before_any_worker(tree, entry, name, tmp_path, capsys, no_pool):
    code = main(_command(tree, entry, tree.bad[name], tmp_path))
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    flag = entry.split()[1]
    message = lines[0].removeprefix("wanmesh: error: ")
    # The file by its path, or by its name where the path would push the line past 300 characters.
    assert message.startswith((f"{flag} {tree.bad[name]}", f"{flag} {tree.bad[name].name}")), lines[0]
    assert BAD_MODEL_FILES[name][1] in message and len(message) <= 300, (len(message), message)


@pytest.mark.parametrize("name", ["gguf_Q8_0", "gguf_Q4_K_M", "fp8_scaled", "diffusers"])
def test_a_lora_for_another_model_is_refused_before_any_worker_on_every_kind(tree, name, tmp_path, capsys, no_pool):
    """The LoRA's deltas are checked against the model's layer shapes read from its header, GGUF included."""
    other = tmp_path / "other_model_lora.safetensors"
    save_file({"diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(5120, 4),
               "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(4, 5120)}, str(other))
    command = _command(tree, "generate --model", tree.written.path(name), tmp_path) + ["--lora", str(other)]
    assert main(command) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "LoRA other_model_lora.safetensors does not fit this model" in line, line


# -- the Model Loader node -----------------------------------------------------------------------------------

def _folder_paths(monkeypatch, folders: dict[str, list[Path]]) -> types.ModuleType:
    """A stand-in for ComfyUI's folder_paths with the given {folder name: folders}."""
    stub = types.ModuleType("folder_paths")
    extensions = {".safetensors"}
    stub.folder_names_and_paths = {name: ([str(p) for p in paths], extensions) for name, paths in folders.items()}

    def names(name):
        roots, suffixes = stub.folder_names_and_paths[name]
        return sorted(str(path.relative_to(root)) for root in map(Path, roots) if Path(root).is_dir()
                      for path in Path(root).rglob("*") if path.suffix in suffixes)

    def full_path(name, file):
        found = [Path(root) / file for root in stub.folder_names_and_paths[name][0] if (Path(root) / file).is_file()]
        return str(found[0]) if found else None

    stub.get_filename_list, stub.get_full_path = names, full_path
    monkeypatch.setitem(sys.modules, "folder_paths", stub)
    return stub


def _unet_only(tree: Tree, tmp_path: Path) -> Path:
    unet = tmp_path / "unet"
    unet.mkdir()
    shutil.copy(tree.written.path("gguf_Q8_0"), unet / "wan_unet_only_Q8_0.gguf")
    return unet


LAYOUTS = {  # how each ComfyUI names the transformer folders (the extra model paths file adds diffusion_models)
    "2024": lambda tree, unet: {"unet": [unet, tree / "diffusion_models"], "diffusion_models": [tree / "diffusion_models"]},
    "recent": lambda tree, unet: {"diffusion_models": [unet, tree / "diffusion_models"]},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_model_loader_lists_and_finds_gguf_files_in_unet_and_diffusion_models(tree, tmp_path, monkeypatch, layout):
    unet = _unet_only(tree, tmp_path)
    _folder_paths(monkeypatch, LAYOUTS[layout](tree, unet))
    from wanmesh.nodes.bridge.files import list_models, list_vace_modules, model_path

    listed = list_models("diffusion_models")
    assert {"wan_unet_only_Q8_0.gguf", "wan_tiny_t2v_Q8_0.gguf", "kinds/wan_tiny_t2v_Q4_K.gguf",
            "wan_tiny_t2v.safetensors"} <= set(listed)
    assert model_path("diffusion_models", "wan_unet_only_Q8_0.gguf") == str(unet / "wan_unet_only_Q8_0.gguf")
    assert "wan_tiny_vace_module.safetensors" in list_vace_modules()


def test_the_model_loader_refuses_a_bad_file_before_any_worker(tree, tmp_path, monkeypatch):
    _folder_paths(monkeypatch, LAYOUTS["recent"](tree, _unet_only(tree, tmp_path)))
    from wanmesh.nodes import loaders

    monkeypatch.setattr(loaders, "_runner", lambda pool: pytest.fail("a runner was asked for before the check"))
    loader = loaders.WanMeshModelLoader()
    for name, (file, message) in BAD_MODEL_FILES.items():
        with pytest.raises(ValueError) as refused:
            loader.load(f"kinds/bad/{file}", "auto", weights="dequantize")
        assert str(refused.value).startswith(f"model_name kinds/bad/{file}:") and message in str(refused.value)
        assert "\n" not in str(refused.value)


class RecordingRunner:
    def __init__(self):
        self.loads = []

    def load_model(self, path, **options):
        self.loads.append((path, options))
        return "model|handle"


def test_the_model_loader_takes_weights_as_an_optional_input_and_passes_it_on(tree, tmp_path, monkeypatch):
    _folder_paths(monkeypatch, LAYOUTS["recent"](tree, _unet_only(tree, tmp_path)))
    from wanmesh.nodes import loaders

    declared = loaders.WanMeshModelLoader.INPUT_TYPES()
    choices, options = declared["optional"]["weights"]
    assert "weights" not in declared["required"]  # saved workflows and API prompts without it still load
    assert choices == ["keep", "dequantize"] and options["default"] == "keep"
    assert "dequantized per layer" in options["tooltip"] and "more memory" in options["tooltip"]
    runner = RecordingRunner()
    monkeypatch.setattr(loaders, "_runner", lambda pool: runner)
    loaders.WanMeshModelLoader().load("wan_unet_only_Q8_0.gguf", "auto")
    loaders.WanMeshModelLoader().load("kinds/wan_tiny_t2v_fp8_scaled.safetensors", "auto", weights="dequantize")
    assert [options["weights"] for _, options in runner.loads] == ["keep", "dequantize"]


@pytest.mark.parametrize("kind", list(UNSUPPORTED_FAMILIES))
def test_an_unsupported_wan_family_is_told_from_its_header_and_refused_by_the_rank_loader(tree, kind):
    """The header names the family (ComfyUI's telltale key); a rank asked to load it anyway refuses it in one line
    naming the family before any tensor is read."""
    import contextlib

    from wanmesh.parallel.weights.checkpoint import ModelFileError
    from wanmesh.parallel.weights.detect import read_header, safetensors_kind
    from wanmesh.parallel.weights.loaders import transformer_weight_source

    path = tree.bad[kind]
    assert safetensors_kind(str(path)) == kind
    assert detect_kind(read_header(path).shapes) == kind
    with contextlib.ExitStack() as stack, pytest.raises(ModelFileError) as refused:
        transformer_weight_source(path, None, stack)
    line = str(refused.value)
    assert BAD_MODEL_FILES[kind][1] in line and "\n" not in line
    assert len(line.replace(str(path), "")) <= 300
