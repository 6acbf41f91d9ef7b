"""Refusals decidable from file headers and settings, each one line of at most 300 characters naming the file or
input, before any worker starts: the command line (exit 2, no pool started), the loader nodes behind a Pool node
(no worker process), and the checks themselves in process. Cases: a head split the model cannot take (tp, Ulysses;
the text encoder's heads too), a text encoder of another width than the model's text embedding, a VAE of another
latent space, NaN / Inf in a LoRA, a chunk folder that cannot be written, the wrong kind of file (an SD1.5-like
file, a VACE module alone), a pickle the weights-only loader refuses."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_runs import run_cli
from wanmesh.parallel.driver import local
from wanmesh.parallel.driver.pool import close_cached_pool, current_pool

MAX_MESSAGE = 300
QUICK = ["--width", "32", "--height", "32", "--frames", "5", "--steps", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tiny_models, tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("refusals")
    t2v = load_file(tiny_models["t2v"])
    narrow = dict(t2v)  # reads 32-wide text embeddings: the tiny umT5 gives 64-wide ones
    narrow["text_embedding.0.weight"] = torch.zeros(t2v["text_embedding.0.weight"].shape[0], 32)
    save_file(narrow, folder / "narrow_text.safetensors", metadata={"num_heads": "4"})
    lora = load_file(tiny_models["lora_comfy"])
    for value, name in ((float("nan"), "nan"), (float("inf"), "inf")):
        damaged = {key: tensor.clone() for key, tensor in lora.items()}
        key = next(key for key in sorted(damaged) if damaged[key].is_floating_point() and damaged[key].numel() > 1)
        damaged[key].view(-1)[1] = value
        save_file(damaged, folder / f"lora_{name}.safetensors")
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(4, 4, 3, 3),
               "first_stage_model.decoder.conv_in.weight": torch.zeros(4, 4, 3, 3),
               "cond_stage_model.transformer.text_model.embeddings.position_ids": torch.zeros(1, 4)},
              folder / "sd15_like.safetensors")
    torch.save({"weight": torch.zeros(2), "evil": types.SimpleNamespace(x=1)}, folder / "pickled.pt")
    read_only = folder / "read_only"
    read_only.mkdir()
    read_only.chmod(0o500)
    return {"folder": folder, "narrow": folder / "narrow_text.safetensors", "lora_nan": folder / "lora_nan.safetensors",
            "lora_inf": folder / "lora_inf.safetensors", "sd15": folder / "sd15_like.safetensors",
            "pickled": folder / "pickled.pt", "read_only": read_only,
            "models": Path(tiny_models["t2v"]).parents[1], **{k: Path(v) for k, v in tiny_models.items()}}


def _one_line(message: str, *parts: str) -> None:
    assert "\n" not in message and len(message) <= MAX_MESSAGE, (len(message), message)
    for part in parts:
        assert part in message, message


# -- the checks in process ---------------------------------------------------------------------------------


def test_text_encoder_width_against_the_model_from_both_headers(files):
    from wanmesh.parallel.validation import check_text_encoder_for_model

    check_text_encoder_for_model(files["text_encoder"], files["t2v"], "--text-encoder", "--model")  # matching: fine
    with pytest.raises(ValueError) as refused:
        check_text_encoder_for_model(files["text_encoder"], files["narrow"], "--text-encoder", "--model")
    _one_line(str(refused.value), "gives 64-wide text embeddings", "narrow_text.safetensors reads 32-wide")


def test_text_encoder_heads_against_tp(files):
    from wanmesh.parallel.config import ParallelConfig
    from wanmesh.parallel.validation import check_model_file

    check_model_file(files["text_encoder"], "text_encoder", "--text-encoder", ParallelConfig(world=2, tp=2))
    with pytest.raises(ValueError) as refused:
        check_model_file(files["text_encoder"], "text_encoder", "--text-encoder", ParallelConfig(world=3, tp=3))
    _one_line(str(refused.value), "--text-encoder", "tp=3 does not divide the text encoder's 4 attention heads")


@pytest.mark.parametrize("kind, what", [("lora_nan", "NaN"), ("lora_inf", "infinite")])
def test_a_lora_with_nan_or_inf_is_refused_naming_the_tensor(files, kind, what):
    from wanmesh.parallel.validation import check_lora_values

    check_lora_values(files["lora_comfy"], "--lora")
    with pytest.raises(ValueError) as refused:
        check_lora_values(files[kind], "--lora")
    _one_line(str(refused.value), f"--lora {files[kind].name}: holds {what} values (tensor ")


def test_wrong_kinds_and_refused_pickles_are_short(files, tmp_path):
    from wanmesh.parallel.weights.checkpoint import ModelFileError, _load_pickle_state_dict
    from wanmesh.parallel.validation import TRANSFORMER_KINDS, inspect_model_file

    deep = tmp_path.joinpath(*["a_long_folder_name_for_the_models"] * 8)
    deep.mkdir(parents=True)
    (deep / "sd15_like.safetensors").write_bytes(files["sd15"].read_bytes())
    for path, parts in ((files["sd15"], ("looks like an unrecognised model; expected a Wan transformer (T2V",)),
                        (deep / "sd15_like.safetensors", ("sd15_like.safetensors looks like an unrecognised",)),
                        (files["vace_module"], ("looks like a VACE module", "give this file as its VACE module"))):
        with pytest.raises(ValueError) as refused:
            inspect_model_file(path, "--model", TRANSFORMER_KINDS)
        _one_line(str(refused.value), "--model", *parts)
    with pytest.raises(ModelFileError) as refused:
        _load_pickle_state_dict(files["pickled"])
    _one_line(str(refused.value), "pickled.pt: the weights-only loader refused it", "convert it to .safetensors")


# -- the command line: exit 2, one line, no pool ------------------------------------------------------------


def _explicit(f, model=None, text=None) -> list[str]:
    return ["--model", str(model or f["t2v"]), "--vae", str(f["vae"]), "--text-encoder", str(text or f["text_encoder"])]


CLI_CASES = [
    ("text-encoder-width", lambda f: ["generate", *_explicit(f, model=f["narrow"])],
     "gives 64-wide text embeddings, but --model"),
    ("lora-nan", lambda f: ["generate", "--models", str(f["models"]), "--lora", str(f["lora_nan"])],
     "lora_nan.safetensors: holds NaN values"),
    ("stream-tp-vs-heads", lambda f: ["stream", "--models", str(f["models"]), "--world", "3", "--tp", "3",
                                      "--chunk-dir", str(f["folder"] / "chunks")],
     "tp=3 does not divide the model's 4 attention heads"),
    ("stream-chunk-folder-read-only", lambda f: ["stream", "--models", str(f["models"]),
                                                 "--chunk-dir", str(f["read_only"] / "chunks")],
     "cannot take the chunk files"),
]


@pytest.mark.parametrize("name, args, message", CLI_CASES, ids=[case[0] for case in CLI_CASES])
def test_the_command_line_refuses_before_any_worker(files, tmp_path, name, args, message):
    if name == "stream-chunk-folder-read-only" and os.geteuid() == 0:  # root writes into read-only folders
        files["read_only"].chmod(0o700)
        (files["read_only"] / "chunks").write_text("a file where the folder should be")
        message = "is a file; give a folder for the chunk files"
    command = args(files)
    extra = QUICK if command[0] == "generate" else ["--device", "cpu", "--steps", "1"]
    if command[0] == "generate" or "--out" not in command:
        command += ["--prompt", "a fox", "--out", str(tmp_path / "x.mp4")]
    result = run_cli(command + extra, tmp_path)
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2, result["stderr"]
    assert len(lines) == 1 and lines[0].startswith("wanmesh: error: "), result["stderr"]
    _one_line(lines[0], message)
    assert not result["pool_started"], "a worker pool was started for input a static check can refuse"


# -- the nodes: a Pool node's settings against the model, before any worker ---------------------------------


@pytest.fixture()
def node_folders(files, monkeypatch):
    """ComfyUI's folder_paths, reduced to the tiny models tree, and no worker may start."""
    module = types.ModuleType("folder_paths")
    module.folder_names_and_paths = {kind: ([str(files["models"] / kind)], set())
                                     for kind in ("diffusion_models", "text_encoders")}

    def get_full_path(kind, name):
        path = files["models"] / kind / name
        return str(path) if path.exists() else None

    module.get_full_path = get_full_path
    monkeypatch.setitem(sys.modules, "folder_paths", module)

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(local.LocalWorkers, "__init__", no_workers)
    close_cached_pool()
    yield
    close_cached_pool()


POOL = dict(devices="cpu", ulysses=1, ring=1, cfg_parallel=False, vae_patch=1, backend="local", ray_address="")


@pytest.mark.parametrize("degrees, message", [
    (dict(world=3, tp=3), "tp=3 does not divide the model's 4 attention heads"),
    (dict(world=3, tp=1, ulysses=3), "tp x ulysses must divide 4"),
], ids=["tp3", "ulysses3"])
def test_a_pool_node_split_the_model_cannot_take_starts_no_worker(files, node_folders, degrees, message):
    from wanmesh.nodes.loaders import WanMeshModelLoader
    from wanmesh.nodes.pool import WanMeshPool

    (runner,) = WanMeshPool().make(**{**POOL, **degrees})
    name = files["t2v"].relative_to(files["models"] / "diffusion_models").as_posix()
    with pytest.raises(ValueError) as refused:
        WanMeshModelLoader().load(name, "auto", pool=runner)
    _one_line(str(refused.value), f"model_name {name}:", message)
    assert current_pool() is not None and not current_pool().running and current_pool().pids() == []


def test_a_pool_node_tp_the_text_encoder_cannot_take_starts_no_worker(files, node_folders):
    from wanmesh.nodes.loaders import WanMeshTextEncoderLoader
    from wanmesh.nodes.pool import WanMeshPool

    (runner,) = WanMeshPool().make(**{**POOL, "world": 3, "tp": 3})
    name = files["text_encoder"].relative_to(files["models"] / "text_encoders").as_posix()
    with pytest.raises(ValueError) as refused:
        WanMeshTextEncoderLoader().load(name, "auto", pool=runner)
    _one_line(str(refused.value), f"text_encoder_name {name}:", "does not divide the text encoder's 4 attention heads")
    assert not current_pool().running
