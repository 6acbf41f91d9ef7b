"""HuMo's network (``parallel/networks/wan_humo.py``) against ComfyUI's own ``HumoWanModel`` (recent copy, run in
its interpreter): the same random weights in the released key layout give the same prediction with audio features
and without (the plain transformer), and the audio changes the prediction; the file in that layout loads as HuMo
(the workers' loader) and predicts the same. Also: a run of tokens that starts mid frame is grouped by frame."""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file
from native_scripts import run_in_comfyui

from wanmesh.parallel.networks.wan_humo import WanHumoTransformer3DModel, frame_runs
from wanmesh.parallel.tiny.models import NATIVE_TRANSFORMER, original_state_dict, original_transformer_names, randomise_
from wanmesh.parallel.weights.detect import detect_kind
from wanmesh.parallel.weights.loaders import convert_wan_transformer_keys, load_transformer

TOLERANCE = 1e-4
NATIVE = r"""
import sys
weights, inputs, out_file, config = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.ops
from comfy.ldm.wan.model import HumoWanModel
from safetensors.torch import load_file, save_file
model = HumoWanModel(operations=comfy.ops.disable_weight_init, **config)
model.load_state_dict(load_file(weights), strict=True)
io = load_file(inputs)
with torch.no_grad():
    audio = model(io["x"], io["t"], io["context"], audio_embed=io["audio"])
    plain = model(io["x"], io["t"], io["context"])
save_file({"audio": audio.contiguous(), "plain": plain.contiguous()}, out_file)
"""


def _released_state(model: WanHumoTransformer3DModel, config: dict) -> dict[str, torch.Tensor]:
    """The model's weights under the released names: the Wan layout's and the audio parts' own."""
    state = model.state_dict()
    base = WanTransformer3DModel(**config)
    base.load_state_dict({key: value for key, value in state.items() if "audio" not in key}, strict=True)
    released = original_state_dict(base, original_transformer_names(config), convert_wan_transformer_keys)
    return {**released, **{key: value.contiguous() for key, value in state.items() if "audio" in key}}


def test_humo_equals_comfyuis_humo_model(recent_comfyui_dir: Path, tmp_path: Path) -> None:
    config = dict(NATIVE_TRANSFORMER)
    model = WanHumoTransformer3DModel(**config)
    randomise_(model, 5)
    model.eval()
    generator = torch.Generator().manual_seed(1)
    io = {"x": torch.randn(1, 16, 3, 4, 6, generator=generator),
          "context": torch.randn(1, 512, config["text_dim"], generator=generator),
          "audio": torch.randn(1, 3, 8, 5, 1280, generator=generator), "t": torch.tensor([700.0])}
    save_file(_released_state(model, config), str(tmp_path / "humo.safetensors"),
              metadata={"num_heads": str(config["num_attention_heads"])})
    save_file(io, str(tmp_path / "inputs.safetensors"))
    native_config = dict(patch_size=(1, 2, 2), in_dim=16, dim=config["num_attention_heads"] * config["attention_head_dim"],
                         ffn_dim=config["ffn_dim"], freq_dim=256, text_dim=config["text_dim"], out_dim=16,
                         num_heads=config["num_attention_heads"], num_layers=config["num_layers"], qk_norm=True,
                         cross_attn_norm=True, eps=1e-6)
    run_in_comfyui(NATIVE, recent_comfyui_dir, tmp_path / "humo.safetensors", tmp_path / "inputs.safetensors",
                   tmp_path / "native.safetensors", repr(native_config))
    native = load_file(str(tmp_path / "native.safetensors"))
    with torch.no_grad():
        ours = model(hidden_states=io["x"], timestep=io["t"], encoder_hidden_states=io["context"],
                     audio_embed=io["audio"], return_dict=False)[0]
        plain = model(hidden_states=io["x"], timestep=io["t"], encoder_hidden_states=io["context"],
                      return_dict=False)[0]
    assert (ours - native["audio"]).abs().max().item() < TOLERANCE
    assert (plain - native["plain"]).abs().max().item() < TOLERANCE
    assert (ours - plain).abs().max().item() > 100 * TOLERANCE, "the audio changed nothing"
    released = load_file(str(tmp_path / "humo.safetensors"))
    assert detect_kind(released) == "wan_humo"
    loaded = load_transformer(str(tmp_path / "humo.safetensors"))
    assert isinstance(loaded, WanHumoTransformer3DModel)
    with torch.no_grad():
        again = loaded(hidden_states=io["x"], timestep=io["t"], encoder_hidden_states=io["context"],
                       audio_embed=io["audio"], return_dict=False)[0]
    torch.testing.assert_close(again, ours, rtol=0, atol=0)


def test_a_run_of_tokens_is_grouped_by_frame() -> None:
    assert frame_runs(0, 12, 6) == [(0, 0, 6), (1, 6, 12)]
    assert frame_runs(4, 9, 6) == [(0, 0, 2), (1, 2, 8), (2, 8, 9)]  # a slice that starts and ends mid frame


def test_the_command_line_refuses_a_humo_model_in_one_line(tmp_path: Path, capsys) -> None:
    """The command line has no audio inputs: a HuMo file is refused before any worker starts, never sampled
    without its audio."""
    from wanmesh.parallel.cli import main

    config = dict(NATIVE_TRANSFORMER)
    model = WanHumoTransformer3DModel(**config)
    file = tmp_path / "humo.safetensors"
    save_file(_released_state(model, config), str(file), metadata={"num_heads": str(config["num_attention_heads"])})
    code = main(["generate", "--model", str(file), "--prompt", "x", "--device", "cpu", "--width", "48", "--height",
                 "32", "--frames", "9", "--out", str(tmp_path / "x.mp4")])
    error = capsys.readouterr().err
    assert code == 2 and error.count("\n") == 1 and "the model is HuMo" in error and "ComfyUI" in error, error
