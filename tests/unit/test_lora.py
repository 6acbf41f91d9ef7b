"""LoRA merge on one rank: every format gives the weights of a dense reference merge computed here, strength 0 and
removal give the base weights back exactly, fp8 and VACE models take LoRAs, and bad LoRAs fail in one line before
sampling."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.weights.lora_files import check_lora_for_model, parse_lora_arg, read_lora_header
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.worker.executors import RankExecutor
from wanmesh.parallel.worker.lora_merge import applied_loras
from wanmesh.parallel.weights.quantized import read_weights

STRENGTH = 0.7


@pytest.fixture(scope="module")
def engine(tiny_models):
    executor = RankExecutor("cpu")
    handle = executor.load_model(str(tiny_models["t2v"]))
    return executor, handle


def _model(engine):
    executor, handle = engine
    return executor._get(handle, "model")


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in read_weights(model).items()}


@pytest.fixture(scope="module")
def base(engine):
    engine[0].apply_loras(engine[1], [])
    return _state(_model(engine))


def _merged_file_model(tmp_path, model_file, add_to_original) -> dict[str, torch.Tensor]:
    """The reference: the LoRA merged densely into the model FILE's own (original) keys, then loaded."""
    state = load_file(model_file)
    for key, delta in add_to_original.items():
        state[key] = (state[key].double() + delta.double()).to(state[key].dtype)
    path = tmp_path / "merged.safetensors"
    save_file(state, str(path), metadata={"num_heads": "4"})
    return load_transformer(str(path)).state_dict()


def _original_deltas(lora: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    deltas = {}
    for key in lora:
        if key.endswith(".lora_up.weight"):
            layer = key[len(prefix):-len(".lora_up.weight")]
            up, down = lora[key].double(), lora[f"{prefix}{layer}.lora_down.weight"].double()
            alpha = lora[f"{prefix}{layer}.alpha"].item() if f"{prefix}{layer}.alpha" in lora else up.shape[1]
            deltas[f"{layer}.weight"] = STRENGTH * alpha / up.shape[1] * (up @ down)
        elif key.endswith((".diff", ".diff_b")):
            layer, _, kind = key[len(prefix):].rpartition(".")
            deltas[f"{layer}.{'weight' if kind == 'diff' else 'bias'}"] = STRENGTH * lora[key].double()
    return deltas


def _diffusers_deltas(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Deltas from diffusers-named lora_A/lora_B pairs (alpha already folded into them)."""
    return {key.removeprefix("transformer.").replace(".lora_B.weight", ".weight"):
            STRENGTH * (lora[key].double() @ lora[key.replace("lora_B", "lora_A")].double())
            for key in lora if key.endswith(".lora_B.weight")}


def _check_merged(engine, base, expected: dict[str, torch.Tensor]):
    merged = _state(_model(engine))
    changed = [name for name in merged if not torch.equal(merged[name], base[name])]
    assert changed, "the LoRA changed nothing"
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name].to(tensor.dtype), rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("fmt", ["comfy", "diff"])
def test_original_key_formats_equal_a_dense_merge_in_the_files_key_space(fmt, engine, base, tiny_models, tmp_path):
    lora = load_file(tiny_models[f"lora_{fmt}"])
    expected = _merged_file_model(tmp_path, tiny_models["t2v"], _original_deltas(lora, "diffusion_model."))
    engine[0].apply_loras(engine[1], [(str(tiny_models[f"lora_{fmt}"]), STRENGTH)])
    _check_merged(engine, base, expected)


def test_peft_format_equals_a_dense_merge_by_diffusers_names(engine, base, tiny_models):
    deltas = _diffusers_deltas(load_file(tiny_models["lora_peft"]))
    expected = {name: base[name].double() + deltas.get(name, 0) for name in base}
    engine[0].apply_loras(engine[1], [(str(tiny_models["lora_peft"]), STRENGTH)])
    _check_merged(engine, base, expected)


def test_kohya_format_equals_diffusers_own_musubi_conversion(engine, base, tiny_models):
    from diffusers.loaders.lora_conversion_utils import _convert_musubi_wan_lora_to_diffusers

    converted = _convert_musubi_wan_lora_to_diffusers(load_file(tiny_models["lora_kohya"]))
    deltas = _diffusers_deltas(converted)
    assert deltas, "diffusers converted nothing"
    expected = {name: base[name].double() + deltas.get(name, 0) for name in base}
    engine[0].apply_loras(engine[1], [(str(tiny_models["lora_kohya"]), STRENGTH)])
    _check_merged(engine, base, expected)


def test_comfy_format_equals_diffusers_own_wan_lora_conversion(engine, base, tiny_models):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    deltas = _diffusers_deltas(_convert_non_diffusers_wan_lora_to_diffusers(load_file(tiny_models["lora_comfy"])))
    expected = {name: base[name].double() + deltas.get(name, 0) for name in base}
    engine[0].apply_loras(engine[1], [(str(tiny_models["lora_comfy"]), STRENGTH)])
    _check_merged(engine, base, expected)


def test_strength_zero_switch_and_removal_give_the_base_weights_back_exactly(engine, base, tiny_models):
    executor, handle = engine
    comfy, kohya = str(tiny_models["lora_comfy"]), str(tiny_models["lora_kohya"])
    executor.apply_loras(handle, [(comfy, 0.0)])
    assert all(torch.equal(t, base[n]) for n, t in _model(engine).state_dict().items())
    executor.apply_loras(handle, [(comfy, 1.0), (kohya, -0.5)])
    executor.apply_loras(handle, [(kohya, -0.5)])  # switch: comfy out, restored from the file
    only_kohya = _state(_model(engine))
    executor.apply_loras(handle, [])
    assert all(torch.equal(t, base[n]) for n, t in _model(engine).state_dict().items())
    executor.apply_loras(handle, [(kohya, -0.5)])
    assert all(torch.equal(t, only_kohya[n]) for n, t in _model(engine).state_dict().items())
    executor.apply_loras(handle, [[kohya, -0.5]])  # lists, as the protocol may bring them: unchanged, nothing done
    assert applied_loras(_model(engine)) == ((kohya, -0.5),)
    executor.apply_loras(handle, [])


def test_strength_zero_samples_exactly_like_no_lora(engine, tiny_models):
    executor, handle = engine
    embeddings = [torch.randn(5, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    request = P.SampleRequest(handle, torch.zeros(latent_shape(32, 32, 5)), embeddings[:1], embeddings[1:],
                              seed=3, steps=2, guidance_scale=4.0, shift=3.0)
    plain = executor.sample(request)
    zero = executor.sample(P.SampleRequest(**{**request.__dict__,
                                              "model_loras": {handle: [(str(tiny_models["lora_comfy"]), 0.0)]}}))
    full = executor.sample(P.SampleRequest(**{**request.__dict__,
                                              "model_loras": {handle: [(str(tiny_models["lora_comfy"]), 1.0)]}}))
    assert torch.equal(plain, zero)
    assert (full - plain).abs().max() > 1e-3
    assert torch.equal(executor.sample(request), plain)  # the request without LoRAs takes them out again


def test_fp8_scaled_base_takes_a_lora_and_restores_its_dequantised_weights(tiny_models, tmp_path):
    state = load_file(tiny_models["t2v"])
    fp8 = {}
    for key, tensor in state.items():
        if key.endswith(".weight") and tensor.ndim == 2:
            scale = tensor.abs().max() / 448
            fp8[key] = (tensor / scale).to(torch.float8_e4m3fn)
            fp8[key.replace(".weight", ".scale_weight")] = scale.reshape(1)
        else:
            fp8[key] = tensor
    path = tmp_path / "fp8_scaled.safetensors"
    save_file({**fp8, "scaled_fp8": torch.zeros(0, dtype=torch.float8_e4m3fn)}, str(path), metadata={"num_heads": "4"})
    executor = RankExecutor("cpu")
    handle = executor.load_model(str(path))
    model = executor._get(handle, "model")
    dequantised = _state(model)
    lora = load_file(tiny_models["lora_comfy"])
    executor.apply_loras(handle, [(str(tiny_models["lora_comfy"]), STRENGTH)])
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_wan_lora_to_diffusers

    deltas = _diffusers_deltas(_convert_non_diffusers_wan_lora_to_diffusers(lora))
    for name, tensor in read_weights(model).items():
        torch.testing.assert_close(tensor, (dequantised[name].double() + deltas.get(name, 0)).float(),
                                   rtol=1e-5, atol=1e-6)
    executor.apply_loras(handle, [])
    assert all(torch.equal(t, dequantised[n]) for n, t in read_weights(model).items())
    assert model.blocks[0].attn1.to_q.parametrizations.weight.original.dtype == torch.float8_e4m3fn  # never expanded


def test_vace_blocks_take_lora_layers(tiny_models, tmp_path):
    generator = torch.Generator().manual_seed(5)
    up, down = torch.randn(128, 4, generator=generator), torch.randn(4, 128, generator=generator)
    path = tmp_path / "vace_lora.safetensors"
    save_file({"diffusion_model.vace_blocks.1.self_attn.q.lora_up.weight": up,
               "diffusion_model.vace_blocks.1.self_attn.q.lora_down.weight": down}, str(path))
    executor = RankExecutor("cpu")
    handle = executor.load_model(str(tiny_models["vace"]))
    model = executor._get(handle, "model")
    before = model.vace_blocks[1].attn1.to_q.weight.detach().clone()
    executor.apply_loras(handle, [(str(path), 0.5)])
    torch.testing.assert_close(model.vace_blocks[1].attn1.to_q.weight, before + 0.5 * up @ down, rtol=1e-5, atol=1e-5)


def _write(tmp_path, name, tensors) -> str:
    path = tmp_path / name
    save_file(tensors, str(path))
    return str(path)


def test_bad_loras_fail_in_one_line_before_sampling(engine, tiny_models, tmp_path, caplog):
    executor, handle = engine
    other_model = _write(tmp_path, "other.safetensors", {
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(1536, 4),
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(4, 1536)})
    wrong_rank = _write(tmp_path, "rank.safetensors", {
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(128, 4),
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(8, 128)})
    wrong_layer = _write(tmp_path, "layer.safetensors", {
        "diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(128, 4),
        "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(4, 128),
        "diffusion_model.blocks.1.ffn.0.lora_up.weight": torch.ones(128, 4),
        "diffusion_model.blocks.1.ffn.0.lora_down.weight": torch.ones(4, 128)})
    no_match = _write(tmp_path, "nomatch.safetensors", {
        "diffusion_model.unet.down.0.lora_up.weight": torch.ones(128, 4),
        "diffusion_model.unet.down.0.lora_down.weight": torch.ones(4, 128)})
    cases = [
        (other_model, "does not fit this model|none of its"),
        (wrong_rank, "ranks differ"),
        (str(tiny_models["t2v"]), "is not a LoRA"),
        (str(tmp_path / "missing.safetensors"), "not found"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            check_lora_for_model(path, [str(tiny_models["t2v"])])
        assert "\n" not in str(error.value)
    for path, message in [(other_model, "does not fit"), (wrong_rank, "ranks differ"), (wrong_layer, "does not fit"),
                          (no_match, "none of its 1 layers matches")]:
        before = _state(_model(engine))
        request = P.SampleRequest(handle, torch.zeros(latent_shape(32, 32, 5)), [torch.zeros(5, 64)],
                                  [torch.zeros(5, 64)], seed=1, steps=1, guidance_scale=1.0, shift=3.0,
                                  model_loras={handle: [(path, 1.0)]})
        steps = []
        with pytest.raises(ValueError, match=message) as error:
            executor.sample(request, progress=lambda s, n: steps.append(s))
        assert "\n" not in str(error.value) and steps == []
        assert all(torch.equal(t, before[n]) for n, t in _model(engine).state_dict().items())
    partly = _write(tmp_path, "partly.safetensors", {**load_file(tiny_models["lora_comfy"]),
                                                     "diffusion_model.blocks.9.self_attn.q.lora_up.weight": torch.ones(128, 4),
                                                     "diffusion_model.blocks.9.self_attn.q.lora_down.weight": torch.ones(4, 128)})
    with caplog.at_level(logging.WARNING, logger="wanmesh.lora"):
        executor.apply_loras(handle, [(partly, 1.0)])
    assert "1 keys/layers match nothing" in caplog.text and "blocks.9.self_attn.q" in caplog.text
    executor.apply_loras(handle, [])


def test_lora_header_and_command_line_argument():
    assert parse_lora_arg("style.safetensors") == ("style.safetensors", 1.0)
    assert parse_lora_arg("style.safetensors:0.5") == ("style.safetensors", 0.5)
    assert parse_lora_arg(r"C:\loras\style.safetensors") == (r"C:\loras\style.safetensors", 1.0)
    assert parse_lora_arg("style.safetensors:50") == ("style.safetensors", 50.0)  # native's range is +-100
    with pytest.raises(ValueError, match="outside -100.0..100.0"):
        parse_lora_arg("style.safetensors:101")


def test_every_format_reads_as_forty_layers(tiny_models):
    for fmt in ("comfy", "peft", "kohya", "diff"):
        header = read_lora_header(tiny_models[f"lora_{fmt}"])
        assert len(header.layers) == 40 and not header.other_keys  # 4 blocks x 10 linears


def test_protocol_round_trips_the_loras():
    request = P.SampleRequest("model|a|b|c", torch.zeros(1), [torch.zeros(1)], [torch.zeros(1)], seed=1, steps=1,
                              guidance_scale=1.0, shift=1.0, model_loras={"model|a|b|c": [("x.safetensors", 0.5)]})
    back = P.decode_message(P.encode_message(request, lambda t: t), lambda t: t)
    assert [tuple(entry) for entry in back.model_loras["model|a|b|c"]] == [("x.safetensors", 0.5)]
    bad = P.SampleRequest("model|a|b|c", torch.zeros(1, 16, 2, 4, 4), [torch.zeros(1, 64)], [torch.zeros(1, 64)],
                          seed=1, steps=1, guidance_scale=1.0, shift=1.0, model_loras={"model|a|b|c": [("x", 150.0)]})
    with pytest.raises(ValueError, match="LoRA strength 150.0 is outside -100.0..100.0"):
        bad.validate()


def _live_tensor_bytes() -> tuple[int, int]:
    import gc
    import warnings

    gc.collect()
    with warnings.catch_warnings():  # isinstance on torch's deprecated module attributes warns
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def test_twenty_switches_keep_no_copy_of_any_weight(engine, tiny_models):
    executor, handle = engine
    comfy, peft, diff = (str(tiny_models[f"lora_{name}"]) for name in ("comfy", "peft", "diff"))
    rounds = [[(comfy, 1.0)], [(comfy, 1.0), (peft, 0.5)], [(diff, 0.7)], []]
    pointers = {name: p.data_ptr() for name, p in _model(engine).named_parameters()}
    for loras in rounds:
        executor.apply_loras(handle, loras)
    before = _live_tensor_bytes()
    for _ in range(20):
        for loras in rounds:
            executor.apply_loras(handle, loras)
    assert _live_tensor_bytes() == before  # no saved base weights, no cached deltas
    assert {name: p.data_ptr() for name, p in _model(engine).named_parameters()} == pointers  # merged in place


@pytest.mark.parametrize("lora_arg, message", [("{other}", "does not fit this model"), ("{comfy}:120", "outside"),
                                               ("{model}", "is not a LoRA")])
def test_command_line_refuses_a_bad_lora_before_the_pool_starts(lora_arg, message, tiny_models, tmp_path, capsys):
    from wanmesh.parallel.cli import main

    other = _write(tmp_path, "other.safetensors", {
        "diffusion_model.blocks.0.ffn.0.lora_up.weight": torch.ones(13824, 4),
        "diffusion_model.blocks.0.ffn.0.lora_down.weight": torch.ones(4, 5120)})
    lora = lora_arg.format(other=other, comfy=tiny_models["lora_comfy"], model=tiny_models["t2v"])
    code = main(["generate", "--models", str(tiny_models["t2v"].parents[1]), "--prompt", "x", "--device", "cpu",
                 "--out", str(tmp_path / "x.mp4"), "--lora", lora])
    assert code == 2
    assert message in capsys.readouterr().err
