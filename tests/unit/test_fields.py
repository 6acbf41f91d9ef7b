"""Every entry point against the table of user-facing fields (``parallel/fields.py``): the node inputs, the CLI
flags, the protocol checks, the settings table of docs/settings.md and the usage block of docs/command-line.md.
A node widget or a flag that is in neither the table nor the short lists of entry-specific inputs below fails too,
so a new setting gets a row."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

from wanmesh.parallel import fields
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.fields import FIELDS, Field, flag_help

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_PAGE, COMMAND_LINE_PAGE = ROOT / fields.SETTINGS_PAGE, ROOT / "docs" / "command-line.md"
WIDGET_TYPES = ("INT", "FLOAT", "BOOLEAN", "STRING")
# Node widgets that belong to one node only: file lists, the prompt, output names, CLIP vision crop, the VACE builders' geometry
# (the command line takes it as --outpaint L,T,R,B and --extend-keep FIRST,LAST), the trim count.
NODE_ONLY = {
    "WanMeshModelLoader.model_name", "WanMeshModelLoader.vace_module", "WanMeshVAELoader.vae_name",
    "WanMeshLoraLoader.lora_name", "WanMeshTextEncoderLoader.text_encoder_name", "WanMeshTextEncode.text",
    "WanMeshStreamSampler.filename_prefix", "WanMeshSaveVideo.filename_prefix", "WanMeshVaceEncode.reference_images",
    "WanMeshTrimLatent.trim_amount", "WanMeshVaceControl.low_threshold", "WanMeshVaceControl.high_threshold",
    "WanMeshVaceControl.width", "WanMeshVaceControl.height", "WanMeshVaceReference.width",
    "WanMeshVaceReference.height", "WanMeshCLIPVisionLoader.clip_name", "WanMeshCLIPVisionEncode.crop",
    *(f"WanMeshVaceMask.{name}" for name in (
        "mode", "width", "height", "length", "box_x", "box_y", "box_w", "box_h", "end_box_x", "end_box_y",
        "end_box_w", "end_box_h", "pad_left", "pad_top", "pad_right", "pad_bottom", "keep_first", "keep_last")),
}
# Flags that are not settings of a node: files, prompts, outputs, the device kind, VACE and image inputs given as
# files.
FLAG_ONLY = {"--models", "--model", "--vae", "--text-encoder", "--vace-module", "--model-low", "--prompt",
             "--negative", "--device", "--out", "--save-latents", "--save-frames", "--lora", "--vace-video",
             "--vace-mask", "--vace-ref", "--outpaint", "--extend-keep", "--save-vace", "--no-kv-cache",
             "--chunk-dir", "--image", "--last-image", "--clip-vision", "--control-video", "--quiet", "-q", "--help", "-h"}
FLAG_ONLY |= {"--camera-motion", "--camera-speed"}  # Fun Camera's preset motions (native WanCameraEmbedding's)
FLAG_ONLY |= {"--prompt-at"}  # prompt switches: prompts, which the node takes as WanMesh Prompt Switch nodes
FLAG_ONLY |= {"--live-prompts"}  # prompts while streaming: the node takes them from its live prompt, not an input


@pytest.fixture(scope="module")
def node_classes():
    stub = types.ModuleType("folder_paths")
    stub.folder_names_and_paths = {name: ([], set()) for name in ("diffusion_models", "text_encoders", "vae", "loras")}
    stub.get_filename_list = lambda name: []
    stub.get_full_path = lambda name, file: None
    saved = sys.modules.get("folder_paths")
    sys.modules["folder_paths"] = stub
    from wanmesh.nodes import NODE_CLASS_MAPPINGS

    yield NODE_CLASS_MAPPINGS
    if saved is None:
        sys.modules.pop("folder_paths", None)
    else:
        sys.modules["folder_paths"] = saved


def _inputs(cls) -> dict:
    spec = cls.INPUT_TYPES()
    return {**spec.get("required", {}), **spec.get("optional", {})}


def _entries(attribute: str):
    return [(row, entry) for row in FIELDS for entry in getattr(row, attribute)]


@pytest.mark.parametrize("row,entry", _entries("nodes"), ids=lambda value: getattr(value, "key", value))
def test_each_node_input_is_its_row(node_classes, row: Field, entry: str):
    node, name = entry.split(".")
    kind, options = _inputs(node_classes[node])[name]
    assert options["tooltip"] == row.help and options.get("default") == row.default, entry
    if row.kind == "CHOICE":  # the sampler lists add ComfyUI's own names after the table's
        assert kind[:len(row.choices)] == list(row.choices), entry
        return
    assert kind == row.kind, entry
    widget = (options.get("min"), options.get("max"), options.get("step"))
    assert widget == (row.low, row.high, row.step), f"{entry}: widget {widget} against the table"


def test_every_node_widget_has_a_row(node_classes):
    in_table = {entry for row in FIELDS for entry in row.nodes}
    missing = [f"{node}.{name}" for node, cls in node_classes.items() for name, (kind, *_) in _inputs(cls).items()
               if (isinstance(kind, list) or kind in WIDGET_TYPES) and f"{node}.{name}" not in in_table | NODE_ONLY]
    assert not missing, f"node widgets with no row in parallel/fields.py: {missing}"


def _command_actions(command: str) -> dict[str, argparse.Action]:
    from wanmesh.parallel.cli import build_parser

    parser = build_parser(bench_options=False)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {flag: action for action in sub._actions for flag in action.option_strings}


@pytest.mark.parametrize("row,entry", _entries("flags"), ids=lambda value: getattr(value, "key", value))
def test_each_flag_is_its_row(row: Field, entry: str):
    command, flag = entry.split(" ")
    action = _command_actions(command)[flag]
    assert action.help == flag_help(row) and action.default == row.cli_default, entry
    if row.kind == "BOOLEAN":
        assert isinstance(action, argparse._StoreTrueAction), entry
    elif row.kind == "CHOICE":
        assert tuple(action.choices) == row.choices, entry
    else:
        assert action.type is fields.FLAG_TYPES[row.kind], entry


@pytest.mark.parametrize("command", ["generate", "stream"])
def test_every_flag_has_a_row(command: str):
    in_table = {entry.split(" ")[1] for row in FIELDS for entry in row.flags if entry.startswith(f"{command} ")}
    aliases = {"--cfg"}  # --guidance-scale's alias, in the same action
    flags = set(_command_actions(command)) - FLAG_ONLY - aliases
    assert flags <= in_table, f"`wanmesh {command}` flags with no row in parallel/fields.py: {sorted(flags - in_table)}"


# -- the protocol checks accept what the table calls valid and refuse the rest ----------------------------------


def _message(name: str, required: dict):
    """A builder of the protocol message ``name`` from valid ``required`` values and the value under test."""
    def build(**changes):
        from wanmesh.parallel import protocol

        return getattr(protocol, name)(**{**required, **changes})
    return build


TEXT = [torch.zeros(1, 4, 8)]
MESSAGES = {
    "SampleRequest": _message("SampleRequest", dict(handle="model", latent=torch.zeros(1, 16, 2, 4, 4), positive=TEXT,
                                                    negative=TEXT, seed=0, steps=4, guidance_scale=5.0, shift=5.0)),
    "StreamSample": _message("StreamSample", dict(handle="model", latent=torch.zeros(1, 16, 5, 4, 4), positive=TEXT,
                                                  negative=TEXT, seed=0, chunk=1)),
    "LoadModel": _message("LoadModel", dict(path="model.safetensors")),
    "EncodeVace": _message("EncodeVace", dict(handle="vae", width=64, height=64, length=5)),
    "ParallelConfig": lambda **changes: ParallelConfig(**changes),
}


def _message_class(owner: str):
    from wanmesh.parallel import protocol

    return ParallelConfig if owner == "ParallelConfig" else getattr(protocol, owner)


def _check(target: str):
    """A callable that raises ValueError for a refused value of the field ``target`` names."""
    owner, attribute = target.rsplit(".", 1)
    if owner in MESSAGES:
        def check(value):
            message = MESSAGES[owner](**{attribute: value})
            getattr(message, "validate", lambda: None)()
        return check
    return getattr(importlib.import_module(f"wanmesh.parallel.{owner}"), attribute)


def _inside_and_outside(row: Field) -> tuple[list, list]:
    valid, whole = row.valid, row.kind == "INT"
    step = 1 if whole else 1e-6
    inside, outside = [], []
    for end, is_open, sign in ((valid.low, valid.low_open, -1), (valid.high, valid.high_open, 1)):
        if end is None:
            continue
        edge = end if whole else float(end)
        (outside if is_open else inside).append(edge)
        outside.append(edge + sign * step)
        if is_open:
            inside.append(edge - sign * step)
    return inside, outside


CHECKED = [(row, target) for row in FIELDS for target in row.checked]


@pytest.mark.parametrize("row,target", [(row, target) for row, target in CHECKED
                                        if row.valid is not None or row.kind == "CHOICE"],
                         ids=lambda value: getattr(value, "key", value))
def test_the_checks_accept_what_the_table_calls_valid(row: Field, target: str):
    check = _check(target)
    if row.kind == "CHOICE":
        for choice in row.choices:
            check(choice)
        with pytest.raises(ValueError) as error:
            check("no-such-" + row.key)
        assert "\n" not in str(error.value) and row.choices[0] in str(error.value)
        return
    inside, outside = _inside_and_outside(row)
    for value in inside:
        check(value)
    for value in outside:
        with pytest.raises(ValueError) as error:
            check(value)
        assert "\n" not in str(error.value), f"{target}={value}: {error.value}"


@pytest.mark.parametrize("row", [row for row in FIELDS if row.valid is not None and row.low is not None],
                         ids=lambda row: row.key)
def test_each_widget_offers_only_valid_values(row: Field):
    """The widget's ends are valid, less the value that stands for "none" (kv_window 0, cfg_low_noise -1: the
    node sends None for it)."""
    valid = row.valid
    for value in (end for end in (row.low, row.high) if end != row.unset):
        assert (valid.low is None or value > valid.low or (value == valid.low and not valid.low_open)) and \
               (valid.high is None or value < valid.high or (value == valid.high and not valid.high_open)), \
               f"{row.key}: the widget offers {value}, which the checks refuse ({valid.text()})"


def test_protocol_attributes_named_by_the_table_exist():
    for row, target in CHECKED:
        owner, attribute = target.rsplit(".", 1)
        if owner in MESSAGES:
            assert attribute in {f.name for f in dataclasses.fields(_message_class(owner))}, target
        else:
            assert callable(_check(target)), target


# -- the documentation pages -----------------------------------------------------------------------------------


def test_the_settings_page_is_the_table():
    text = SETTINGS_PAGE.read_text(encoding="utf-8")
    assert fields.page_with_table(text) == text, (
        f"{fields.SETTINGS_PAGE}'s settings table differs from parallel/fields.py; "
        f"run `python -m wanmesh.parallel.fields {fields.SETTINGS_PAGE}`")


@pytest.mark.parametrize("command", ["generate", "stream"])
def test_the_command_line_usage_names_every_flag_of_the_table(command: str):
    text = COMMAND_LINE_PAGE.read_text(encoding="utf-8")
    usage = re.search(rf"^wanmesh {command} .*?(?=^wanmesh )", text, re.S | re.M).group(0)
    flags = [entry.split(" ")[1] for row in FIELDS for entry in row.flags if entry.startswith(f"{command} ")]
    missing = [flag for flag in flags if not re.search(rf"{re.escape(flag)}(?![\w-])", usage)]
    assert not missing, f"docs/command-line.md's `wanmesh {command}` usage lacks {missing}"


def test_defaults_are_finite_and_inside_their_widgets():
    for row in FIELDS:
        if row.kind in ("INT", "FLOAT"):
            assert math.isfinite(row.default) and row.low <= row.default <= row.high, row.key
        if row.kind == "CHOICE":
            assert row.default in row.choices, row.key
