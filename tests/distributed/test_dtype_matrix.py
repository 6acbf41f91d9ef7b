"""Every layout in the GPU's dtypes: bf16 and fp16 runs of every parallel mode, against one device in the same
dtype and against the fp32 result, on the tiny models (CPU ranks, gloo).

The matrix: features (text-to-video through ComfyUI's uni_pc and through wan_unipc, VACE with two contexts,
image-to-video with CLIP vision tokens, chained LoRAs, GGUF Q8_0 and scaled fp8 kept quantized, one native-MODEL
call, a causal stream, the same stream with a prompt switch, and with a re-anchored rolling window, a VAE decode) x layouts (world 1, tp 2, ulysses 2, ring 2, cfg parallel 2, VAE patch 2 for
the decode; streams run where streaming runs: world 1, tp 2, ulysses 2) x dtypes (bf16, fp16).

Tolerances (relative: ``|a - b| / |b|`` in the Frobenius norm over the whole result):
- against the fp32 result of the same inputs on one device: ``DTYPE_TOLERANCE`` (bf16 has 8 bits of mantissa,
  fp16 11; a few steps compound them), and the half-precision result must differ from fp32 at all
  (``MIN_HALF_ERROR``), which proves the model computed in the requested dtype;
- a layout against world 1 in the same dtype: ``LAYOUT_TOLERANCE``; they differ only by the order of reductions
  (tp's all-reduce of partial sums in the compute dtype, ring's log-sum-exp merge, batch row splits).
Measured on this matrix (2026-11, this CPU): bf16 vs fp32 0.5-1.6e-2, fp16 vs fp32 0.7-1.9e-3; against world
1 in the same dtype, Ulysses and CFG parallel are bit-identical in bf16, tp 2 and ring 2 are 0.5-1.7e-2 off in bf16
and 0.6-2.1e-3 in fp16: a sum split over ranks rounds its partial results to the compute dtype (tp's row-parallel
outputs before their all-reduce, ring's per-block attention outputs before the float32 log-sum-exp merge), which
is the size of the dtype's own rounding.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checks import DTYPE_TOLERANCE, LAYOUT_TOLERANCE, MIN_HALF_ERROR, relative_error
from pool_helpers import cpu_pool, random_prompt_request, tiny_models_within
from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.image_to_video import start_image_video
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 1500
DTYPES = ("bf16", "fp16")
LAYOUTS = {"world1": dict(world=1), "tp2": dict(world=2, tp=2), "ulysses2": dict(world=2, ulysses=2),
           "ring2": dict(world=2, ring=2), "cfg2": dict(world=2, cfg_parallel=True)}
STREAM_LAYOUTS = ("world1", "tp2", "ulysses2")
SAMPLED = ("t2v", "t2v_wan_unipc", "vace", "i2v", "lora", "gguf_q8_0_kept", "fp8_scaled_kept")
STREAMED = ("stream", "stream_switch", "stream_reanchor")
FEATURES = (*SAMPLED, "forward", *STREAMED)
WIDTH, HEIGHT, LENGTH = 48, 32, 9
I2V_TEXT_WIDTH = 4096  # the image-to-video tiny model is a native twin: umT5-XXL's width
MODEL_FILES = {"t2v": "t2v", "t2v_wan_unipc": "t2v", "vace": "vace", "i2v": "i2v", "lora": "t2v",
               "gguf_q8_0_kept": "t2v_gguf_q8_0", "fp8_scaled_kept": "t2v_fp8_scaled", "forward": "t2v",
               "stream": "t2v", "stream_switch": "t2v", "stream_reanchor": "t2v"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _latent(channels: int = 16) -> torch.Tensor:
    return torch.zeros(latent_shape(WIDTH, HEIGHT, LENGTH)[:1] + (channels,) + latent_shape(WIDTH, HEIGHT,
                                                                                              LENGTH)[2:])


def _vace_fields() -> dict:
    generator = torch.Generator().manual_seed(6)
    frames = (LENGTH - 1) // 4 + 1
    vace = [torch.randn(1, 32, frames, HEIGHT // 8, WIDTH // 8, generator=generator) for _ in range(2)]
    masks = [torch.rand(1, 64, frames, HEIGHT // 8, WIDTH // 8, generator=generator).round() for _ in range(2)]
    return dict(vace_frames=vace, vace_masks=masks, vace_strengths=[1.0, 0.5])


def _i2v_fields() -> dict:
    generator = torch.Generator().manual_seed(7)
    frames = (LENGTH - 1) // 4 + 1
    _, mask = start_image_video(torch.rand(1, 40, 40, 3, generator=generator), WIDTH, HEIGHT, LENGTH)
    return dict(image_latents=torch.randn(1, 16, frames, HEIGHT // 8, WIDTH // 8, generator=generator),
                image_mask=mask, clip_fea=torch.randn(1, 257, 1280, generator=generator))


def _sample_request(feature: str, handle: str, tiny: dict) -> P.SampleRequest:
    generator = torch.Generator().manual_seed(5)
    common = dict(handle=handle, seed=11, steps=3, guidance_scale=4.0, shift=3.0)
    if feature == "i2v":
        positive, negative = (torch.randn(512, I2V_TEXT_WIDTH, generator=generator) for _ in range(2))
        return P.SampleRequest(latent=_latent(), positive=[positive], negative=[negative], sampler="euler",
                               **common, **_i2v_fields())
    extra = {"t2v_wan_unipc": dict(sampler="wan_unipc"), "vace": _vace_fields(),
             "lora": dict(model_loras={handle: [(tiny["lora_comfy"], 0.8), (tiny["lora_kohya"], -0.6)]})}
    return random_prompt_request(_latent(), generator, (9, 4), **common, **extra.get(feature, {}))


def _forward_request(handle: str) -> P.ModelForward:
    generator = torch.Generator().manual_seed(8)
    shape = (2, *latent_shape(WIDTH, HEIGHT, LENGTH)[1:])
    return P.ModelForward(handle=handle, latent=torch.randn(shape, generator=generator),
                          timestep=torch.tensor([700.0, 700.0]), context=torch.randn(2, 9, 64, generator=generator))


def _stream_request(handle: str, switch: bool = False, reanchor: bool = False) -> P.StreamSample:
    """A stream of 3 chunks; with ``switch`` its prompt changes before the last (the caches rebuilt under it); with
    ``reanchor`` a window of 3 frames, sink 1, re-anchored (it rolls for the chunks ending at 4 and 5)."""
    generator = torch.Generator().manual_seed(9)
    positive, later = torch.randn(9, 64, generator=generator), torch.randn(9, 64, generator=generator)
    return P.StreamSample(handle=handle, latent=torch.zeros(latent_shape(32, 32, 17)), positive=[positive],
                          negative=[], seed=4, steps=2, chunk=2, vae_handle=None, preview=False,
                          switch_chunks=[2] if switch else [], switch_positive=[[later]] if switch else [],
                          **(dict(kv_window=3, sink=1, reanchor=True) if reanchor else {}))


def _load(engine, tiny: dict, feature: str, dtype: str) -> str:
    weights = "keep" if feature.endswith("_kept") else "dequantize"
    return engine.load_model(str(tiny[MODEL_FILES[feature]]), dtype=dtype, weights=weights)


def _run(engine, tiny: dict, feature: str, dtype: str) -> torch.Tensor:
    """The feature's result on ``engine`` (an in-process executor or a pool's runner) in ``dtype``."""
    handle = _load(engine, tiny, feature, dtype)
    try:
        if feature == "forward":
            return engine.forward(_forward_request(handle))
        if feature in STREAMED:
            stream = engine.stream(_stream_request(handle, switch=feature == "stream_switch",
                                                   reanchor=feature == "stream_reanchor"))
            return stream.latents if isinstance(stream, P.Streamed) else stream[0]
        return engine.sample(_sample_request(feature, handle, tiny))
    finally:
        engine.unload(handle)


def _features_of(layout: str) -> tuple[str, ...]:
    return FEATURES if layout in STREAM_LAYOUTS else SAMPLED + ("forward",)


@pytest.fixture(scope="module")
def fp32_reference(tiny) -> dict[str, torch.Tensor]:
    engine = RankExecutor("cpu")
    return {feature: _run(engine, tiny, feature, "fp32") for feature in FEATURES}


@pytest.fixture(scope="module")
def results(tiny) -> dict[tuple[str, str, str], torch.Tensor]:
    """(layout, dtype, feature) -> result; world 1 runs in this process, the other layouts on 2-rank pools."""
    out = {}
    engine = RankExecutor("cpu")
    for dtype in DTYPES:
        for feature in FEATURES:
            out["world1", dtype, feature] = _run(engine, tiny, feature, dtype)
    for layout, config in LAYOUTS.items():
        if layout == "world1":
            continue
        with cpu_pool(**config) as pool:
            runner = PoolRunner(pool)
            for dtype in DTYPES:
                for feature in _features_of(layout):
                    out[layout, dtype, feature] = _run(runner, tiny, feature, dtype)
    return out


MATRIX = [(layout, dtype, feature) for layout in LAYOUTS for dtype in DTYPES for feature in _features_of(layout)]


@pytest.mark.parametrize("layout, dtype, feature", MATRIX)
def test_half_precision_layout_is_close_to_fp32_and_to_world1(results, fp32_reference, layout, dtype, feature):
    value = results[layout, dtype, feature]
    reference = fp32_reference[feature]
    assert value.shape == reference.shape and value.dtype == torch.float32
    assert torch.isfinite(value).all()
    error = relative_error(value, reference)
    world1 = results["world1", dtype, feature]
    print(f"{layout} {dtype} {feature}: {error:.2e} from fp32, {relative_error(value, world1):.2e} from world 1")
    assert MIN_HALF_ERROR < error <= DTYPE_TOLERANCE[dtype], f"{dtype} vs fp32: {error:.2e}"
    assert relative_error(value, world1) <= LAYOUT_TOLERANCE[dtype], (
        f"{layout} vs world 1 in {dtype}: {relative_error(value, world1):.2e}")


def test_the_features_differ_from_each_other(fp32_reference):
    """The matrix compares different computations: each feature's conditioning changes the result."""
    plain = fp32_reference["t2v"]
    for feature in ("vace", "lora", "t2v_wan_unipc"):
        assert relative_error(fp32_reference[feature], plain) > 4 * DTYPE_TOLERANCE["bf16"], feature
    switched, stream = fp32_reference["stream_switch"], fp32_reference["stream"]
    assert torch.equal(switched[:, :, :4], stream[:, :, :4])  # the chunks before the switch
    assert relative_error(switched[:, :, 4:], stream[:, :, 4:]) > 4 * DTYPE_TOLERANCE["bf16"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_vae_decode_with_vae_patch_in_half_precision(tiny, dtype):
    """The VAE in bf16 / fp16: world 1 against fp32, VAE patch 2 against world 1 in the same dtype."""
    latents = torch.randn(1, 16, 3, 6, 8, generator=torch.Generator().manual_seed(3))
    tile = dict(tile_px=32, overlap_px=8)
    runner_frames = {}
    for layout, config in (("world1", dict(world=1)), ("vae_patch2", dict(world=2, vae_patch=2))):
        with cpu_pool(**config) as pool:
            runner = PoolRunner(pool)
            for name in ("fp32", dtype):
                runner_frames[layout, name] = runner.decode(runner.load_vae(tiny["vae"], dtype=name), latents,
                                                            **tile)
    fp32 = runner_frames["world1", "fp32"]
    half = runner_frames["world1", dtype]
    assert half.dtype == torch.float32 and half.shape == fp32.shape
    assert MIN_HALF_ERROR < relative_error(half, fp32) <= DTYPE_TOLERANCE[dtype]
    assert relative_error(runner_frames["vae_patch2", dtype], half) <= LAYOUT_TOLERANCE[dtype]
