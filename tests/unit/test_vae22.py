"""The Wan 2.2 VAE (48 latent channels, 16x16 spatial and 4x temporal compression): its single file (original layout,
maybe prefixed) and a diffusers folder load with the factors from their shapes, encode and decode on one rank's
executor give diffusers' own results, and the Wan 2.1 VAE stays what it was. Bad files give one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from wanmesh.parallel import protocol as P
from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.weights.detect import infer_vae_config
from wanmesh.parallel.weights.vae22_keys import (
    WAN22_LATENTS_MEAN,
    WAN22_LATENTS_STD,
    convert_wan22_vae_keys,
    is_wan22_vae,
)
from wanmesh.parallel.weights.loaders import load_vae
from wanmesh.parallel.tiny.vae22 import TINY_VAE22, TINY_VAE22_FILE, build_tiny_vae22, write_tiny_vae22
from wanmesh.parallel.worker.executors import RankExecutor

FRAMES = (5, 48, 64, 3)  # 5 frames of 64x48 px -> latents [1, 48, 2, 3, 4]
LATENTS = (1, 48, 2, 3, 4)


@pytest.fixture(scope="module")
def vae22_file(tmp_path_factory):
    return write_tiny_vae22(tmp_path_factory.mktemp("vae22"))


@pytest.fixture(scope="module")
def reference():
    return build_tiny_vae22()


@pytest.fixture(scope="module")
def vae21_file(tmp_path_factory):
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    from wanmesh.parallel.tiny.models import TINY_VAE, original_state_dict, original_vae_names, randomise_

    vae = AutoencoderKLWan(**TINY_VAE)
    randomise_(vae, 5)
    path = tmp_path_factory.mktemp("vae21") / "wan_tiny_vae.safetensors"
    save_file(original_state_dict(vae, original_vae_names(TINY_VAE), convert_wan_vae_to_diffusers), str(path))
    return path


@pytest.fixture(scope="module")
def executor_and_handle(vae22_file):
    executor = RankExecutor("cpu")
    return executor, executor.load_vae(str(vae22_file), dtype="fp32")


def same_weights(model, reference) -> None:
    expected = reference.state_dict()
    state = model.state_dict()
    assert set(state) == set(expected)
    assert all(torch.equal(state[name], tensor) for name, tensor in expected.items())


def one_line_error(error_type, call, match: str) -> str:
    with pytest.raises(error_type, match=match) as raised:
        call()
    assert "\n" not in str(raised.value), str(raised.value)
    return str(raised.value)


def write_edited(source, target, edit) -> str:
    state = load_file(str(source))
    edit(state)
    save_file(state, str(target))
    return str(target)


def test_the_tiny_file_is_a_wan22_vae_with_its_factors_from_the_shapes(vae22_file, reference):
    assert str(vae22_file).endswith(TINY_VAE22_FILE)
    vae = load_vae(str(vae22_file))
    config = vae.config
    assert (config.z_dim, config.scale_factor_spatial, config.scale_factor_temporal) == (48, 16, 4)
    assert (config.base_dim, config.decoder_base_dim, config.patch_size, config.is_residual) == (8, 16, 2, True)
    assert (config.in_channels, config.out_channels) == (12, 12)
    assert list(config.latents_mean) == list(WAN22_LATENTS_MEAN) and list(config.latents_std) == list(WAN22_LATENTS_STD)
    assert len(WAN22_LATENTS_MEAN) == len(WAN22_LATENTS_STD) == 48
    same_weights(vae, reference)


def test_the_config_inferred_from_shapes_is_the_written_one(vae22_file):
    shapes = {key: tuple(tensor.shape) for key, tensor in load_file(str(vae22_file)).items()}
    assert is_wan22_vae(shapes)
    inferred = infer_vae_config(shapes)
    assert inferred == {key: TINY_VAE22[key] for key in inferred}


@pytest.mark.parametrize("prefix", ["first_stage_model.", "vae."])
def test_a_prefixed_file_loads_the_same(vae22_file, reference, tmp_path, prefix):
    prefixed = write_edited(vae22_file, tmp_path / "prefixed.safetensors",
                            lambda state: state.update({prefix + key: state.pop(key) for key in list(state)}))
    same_weights(load_vae(prefixed), reference)


def test_a_diffusers_folder_loads_with_its_factor_and_statistics_checked(reference, tmp_path):
    folder = tmp_path / "vae"
    reference.save_pretrained(folder)
    same_weights(load_vae(str(folder)), reference)
    config = json.loads((folder / "config.json").read_text())
    bare = {k: v for k, v in config.items() if k not in ("scale_factor_spatial", "latents_mean", "latents_std")}
    (folder / "config.json").write_text(json.dumps(bare))
    filled = load_vae(str(folder)).config  # a config without them gets them (diffusers' defaults are Wan 2.1's)
    assert filled.scale_factor_spatial == 16 and list(filled.latents_std) == list(WAN22_LATENTS_STD)
    (folder / "config.json").write_text(json.dumps({**config, "scale_factor_spatial": 8}))
    one_line_error(ModelFileError, lambda: load_vae(str(folder)), "scale_factor_spatial 8, but its structure gives 16")
    (folder / "config.json").write_text(json.dumps({**config, "is_residual": False}))
    one_line_error(ModelFileError, lambda: load_vae(str(folder)), "48 latent channels but is not the Wan 2.2 VAE")


def test_encode_and_decode_on_one_rank_give_diffusers_results(executor_and_handle, reference):
    executor, handle = executor_and_handle
    generator = torch.Generator().manual_seed(3)
    frames, latents = torch.rand(*FRAMES, generator=generator), torch.randn(*LATENTS, generator=generator)
    encoded, decoded = executor.encode(handle, frames), executor.decode(handle, latents)
    assert encoded.shape == LATENTS and decoded.shape == FRAMES
    with torch.no_grad():
        expected_latents = reference.encode(frames.permute(3, 0, 1, 2)[None] * 2 - 1).latent_dist.mode()
        expected_pixels = reference.decode(latents).sample  # diffusers clamps to -1..1
    expected_frames = ((expected_pixels + 1) / 2).permute(0, 2, 3, 4, 1).reshape(FRAMES)
    assert float(decoded.std()) > 0.05
    torch.testing.assert_close(encoded, expected_latents, rtol=0, atol=1e-6)
    torch.testing.assert_close(decoded, expected_frames, rtol=0, atol=1e-6)


def test_tiles_of_16_pixel_multiples_keep_the_shapes_and_one_tile_is_the_whole_frame(executor_and_handle):
    executor, handle = executor_and_handle
    generator = torch.Generator().manual_seed(4)
    frames, latents = torch.rand(*FRAMES, generator=generator), torch.randn(*LATENTS, generator=generator)
    assert executor.decode(handle, latents, tile_px=32, overlap_px=16).shape == FRAMES
    assert executor.encode(handle, frames, tile_px=32, overlap_px=16).shape == LATENTS
    torch.testing.assert_close(executor.decode(handle, latents, tile_px=64), executor.decode(handle, latents),
                               rtol=0, atol=0)
    torch.testing.assert_close(executor.encode(handle, frames, tile_px=64), executor.encode(handle, frames),
                               rtol=0, atol=0)


def test_frames_of_any_size_and_count_are_cut_to_16_pixels_and_4k_plus_1_frames(executor_and_handle):
    executor, handle = executor_and_handle
    frames = torch.rand(7, 53, 44, 3, generator=torch.Generator().manual_seed(5))
    encoded = executor.encode(handle, frames)
    assert encoded.shape == (1, 48, 2, 3, 2)  # 48x32 px around the centre, the first 5 frames
    torch.testing.assert_close(encoded, executor.encode(handle, frames[:5, 2:50, 6:38].contiguous()), rtol=0, atol=0)


def test_wrong_sizes_for_the_wan22_vae_are_one_line_errors(executor_and_handle):
    executor, handle = executor_and_handle
    latents = torch.randn(*LATENTS)
    # Decode tiles follow native VAEDecodeTiled: a tile that is no multiple of the spatial factor is floored to one.
    assert torch.equal(executor.decode(handle, latents, tile_px=24, overlap_px=0),
                       executor.decode(handle, latents, tile_px=16, overlap_px=0))
    one_line_error(ValueError, lambda: executor.encode(handle, torch.rand(5, 12, 40, 3)),
                   r"height 12 is smaller than the VAE's 16 pixels \(valid: 16 or more\)")
    one_line_error(ValueError, lambda: executor.decode(handle, torch.randn(1, 16, 2, 3, 4)), r"\[B, 48, T, h, w\]")
    one_line_error(ValueError, lambda: executor.encode_vace(P.EncodeVace(handle=handle, width=64, height=48, length=5)),
                   "VACE conditioning is made with the Wan 2.1 VAE")


def test_a_wan21_vae_file_is_still_the_wan21_vae(vae21_file):
    shapes = {key: tuple(tensor.shape) for key, tensor in load_file(str(vae21_file)).items()}
    assert not is_wan22_vae(shapes)
    assert infer_vae_config(shapes) == {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
                                        "attn_scales": [], "temperal_downsample": [False, True, True]}
    executor = RankExecutor("cpu")
    handle = executor.load_vae(str(vae21_file), dtype="fp32")
    vae = executor._get(handle, "vae")
    assert (vae.config.z_dim, vae.config.scale_factor_spatial, vae.config.patch_size, vae.config.is_residual) == (
        16, 8, None, False)
    assert executor.decode(handle, torch.randn(1, 16, 2, 3, 4)).shape == (5, 24, 32, 3)
    assert executor.encode(handle, torch.rand(5, 29, 37, 3)).shape == (1, 16, 2, 3, 4)  # cut to 24x32 px


def test_bad_wan22_files_are_one_line_errors(vae22_file, tmp_path):
    cases = {
        "missing": (lambda state: state.pop("decoder.conv1.bias"), r"missing 1 tensors: decoder\.conv_in\.bias"),
        "unexpected": (lambda state: state.update({"decoder.extra.weight": torch.zeros(1)}),
                       r"unexpected 1 tensors: decoder\.extra\.weight"),
        "no_head": (lambda state: state.pop("decoder.head.2.weight"), "lacks the tensor 'decoder.head.2.weight'"),
        "channels": (lambda state: state.update({"conv2.weight": torch.zeros(32, 32, 1, 1, 1)}),
                     "Wan 2.2 layout has 32 latent channels; only the Wan 2.2 VAE's 48"),
    }
    for name, (edit, match) in cases.items():
        bad = write_edited(vae22_file, tmp_path / f"{name}.safetensors", edit)
        one_line_error(ModelFileError, lambda: load_vae(bad), match)


def test_a_48_channel_vae_in_the_wan21_layout_and_a_transformer_are_refused(vae21_file, tmp_path):
    wide = write_edited(vae21_file, tmp_path / "wide.safetensors",
                        lambda state: state.update({"conv2.weight": torch.zeros(48, 48, 1, 1, 1)}))
    one_line_error(ModelFileError, lambda: load_vae(wide), "48 latent channels in the Wan 2.1 key layout.*Wan 2.2 VAE")
    transformer = tmp_path / "transformer.safetensors"
    save_file({"patch_embedding.weight": torch.zeros(8, 16, 1, 2, 2), "blocks.0.self_attn.q.weight": torch.zeros(8, 8)},
              str(transformer))
    one_line_error(ModelFileError, lambda: load_vae(str(transformer)), "expected a Wan VAE")


def test_the_name_map_refuses_two_tensors_for_one_weight():
    one_line_error(ModelFileError, lambda: convert_wan22_vae_keys({"conv1.weight": 0, "quant_conv.weight": 1}),
                   "two tensors for 'quant_conv.weight'")


def test_the_native_width_twin_is_the_tiny_draw_in_bf16(monkeypatch, tmp_path, vae22_file):
    """``write_native_vae22`` (the release widths native VAELoader builds) draws what ``build_tiny_vae22`` draws at
    the same widths, tensor by tensor, in bf16 and the original layout; here at the tiny widths, so it is cheap."""
    from wanmesh.parallel.tiny import vae22

    monkeypatch.setattr(vae22, "NATIVE_VAE22_WIDTHS", {key: TINY_VAE22[key] for key in ("base_dim", "decoder_base_dim")})
    written = load_file(str(vae22.write_native_vae22(tmp_path)))
    tiny = load_file(str(vae22_file))
    assert set(written) == set(tiny) and {tensor.dtype for tensor in written.values()} == {torch.bfloat16}
    assert all(torch.equal(written[key], tiny[key].to(torch.bfloat16)) for key in tiny)


def test_make_tiny_native_vae22_flag_writes_the_twin(monkeypatch, tmp_path, capsys):
    from wanmesh.parallel import cli
    from wanmesh.parallel.tiny import models, vae22

    monkeypatch.setattr(models, "make_models", lambda directory, preset, progress: {})
    monkeypatch.setattr(vae22, "write_native_vae22", lambda root: tmp_path / vae22.NATIVE_VAE22_FILE)
    assert cli.main(["make-tiny", str(tmp_path), "--native-vae22", "--quiet"]) == 0
    assert str(tmp_path / vae22.NATIVE_VAE22_FILE) in capsys.readouterr().out
