"""Wan 2.2 TI2V 5B on one device: its config is inferred and loads (48 latent channels, "first_frame" image inputs),
the channel checks take 48-channel latents and refuse what does not fit in one line, the Wan 2.2 latent stats
normalise 48-channel latents, and the noise-mask arithmetic (native Wan22ImageToVideoLatent's LATENT, ComfyUI's mask
resizing, WAN22's per-frame timesteps, diffusers' per-token timesteps) and the sampling loop's use of it equal
hand-computed cases."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from wanmesh.nodes.bridge.pool_model import call_timesteps
from wanmesh.parallel.config import (WAN22_LATENTS_MEAN, WAN22_LATENTS_STD, check_latent, check_model_forward,
                                     check_model_input, check_noise_mask)
from wanmesh.parallel.image_to_video import (frame_timesteps, latent_noise_mask, wan22_image_latent,
                                             wan22_start_frames)
from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.weights.detect import check_latent_channels, image_inputs, infer_transformer_config
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import ModelForward, SampleRequest
from wanmesh.parallel.sampling.forward import forward_rows
from wanmesh.parallel.sampling.guidance import token_timesteps
from wanmesh.parallel.sampling.latents import (denormalize_latents, latent_stats, model_space_latents,
                                              normalize_latents)
from wanmesh.parallel.sampling.loop import sample
from wanmesh.parallel.sampling.preview import preview_image
from wanmesh.parallel.tiny.models import NATIVE_TI2V

SHAPE = (1, 48, 3, 3, 4)  # 64 x 48 pixels, 9 frames at the Wan 2.2 VAE's 16x


def _ti2v_shapes(dim: int = 3072, layers: int = 30) -> dict[str, tuple[int, ...]]:
    """The released TI2V 5B's shapes (original layout) that the config is read from."""
    shapes = {"patch_embedding.weight": (dim, 48, 1, 2, 2), "head.head.weight": (48 * 4, dim),
              "text_embedding.0.weight": (dim, 4096), "time_embedding.0.weight": (dim, 256),
              "blocks.0.ffn.0.weight": (14336, dim), "blocks.0.norm3.weight": (dim,),
              "blocks.0.self_attn.norm_q.weight": (dim,)}
    shapes.update({f"blocks.{i}.self_attn.q.weight": (dim, dim) for i in range(layers)})
    return shapes


def test_the_ti2v_5b_config_is_inferred_and_takes_first_frame_inputs():
    config = infer_transformer_config(_ti2v_shapes(), None)
    assert (config["in_channels"], config["out_channels"], config["num_attention_heads"], config["num_layers"]) == \
        (48, 48, 24, 30)
    assert "image_dim" not in config and "vace_layers" not in config
    assert image_inputs(config) == "first_frame"
    assert image_inputs({"in_channels": 16}) is None and image_inputs({"in_channels": 36}) == "latents"


def test_latent_channel_checks():
    check_latent_channels(48)
    with pytest.raises(ModelFileError, match=r"takes 32 input channels.*48 \(Fun Control, Wan 2.2 TI2V 5B\)"):
        check_latent_channels(32)
    check_latent(torch.zeros(SHAPE))
    check_model_input(torch.zeros(SHAPE))
    with pytest.raises(ValueError, match=r"latent must be \[B, 16, T, H/8, W/8\] or \[B, 48, T, H/16, W/16\]"):
        check_latent(torch.zeros(1, 32, 3, 3, 4))


def test_model_forward_takes_per_frame_timesteps():
    latent, context = torch.zeros(2, *SHAPE[1:]), torch.zeros(2, 7, 4096)
    check_model_forward(latent, torch.zeros(2), context, None, [])
    check_model_forward(latent, torch.zeros(2, 3), context, None, [])
    with pytest.raises(ValueError, match=r"per row and latent frame \(\[2, 3\]\)"):
        check_model_forward(latent, torch.zeros(2, 4), context, None, [])


def test_a_noise_mask_is_refused_on_wan21_latents_and_taken_by_every_sampler():
    mask = torch.ones(1, 1, 3, 3, 4)
    for sampler in ("euler", "uni_pc", "unipc", "wan_unipc"):
        check_noise_mask(mask, SHAPE, sampler)
    with pytest.raises(ValueError, match="native inpainting masks are not supported for Wan 2.1") as error:
        check_noise_mask(mask, (1, 16, 3, 6, 8), "euler")
    assert "\n" not in str(error.value)
    request = SampleRequest(handle="h", latent=torch.zeros(1, 16, 3, 6, 8), positive=[torch.zeros(4, 8)],
                            negative=[torch.zeros(4, 8)], seed=1, steps=2, guidance_scale=1.0, shift=5.0,
                            sampler="euler", noise_mask=mask)
    with pytest.raises(ValueError, match="not supported for Wan 2.1"):
        request.validate()


def test_wan22_latents_normalise_with_the_wan22_stats():
    mean, std = latent_stats(48)
    assert mean.flatten().tolist() == pytest.approx(WAN22_LATENTS_MEAN) and std.flatten().tolist() == pytest.approx(
        WAN22_LATENTS_STD)
    raw = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    expected = (raw - torch.tensor(WAN22_LATENTS_MEAN).view(1, -1, 1, 1, 1)) / torch.tensor(WAN22_LATENTS_STD).view(
        1, -1, 1, 1, 1)
    torch.testing.assert_close(normalize_latents(raw), expected)
    torch.testing.assert_close(denormalize_latents(normalize_latents(raw)), raw)
    assert latent_stats(16)[0].shape == (1, 16, 1, 1, 1)
    with pytest.raises(ValueError, match="latents have 20 channels; valid: 16 or 48"):
        latent_stats(20)
    assert torch.equal(model_space_latents(torch.zeros(SHAPE)), torch.zeros(SHAPE))  # ComfyUI: empty stays empty
    assert preview_image(expected).shape == (3, 4, 3)


def test_wan22_image_latent_is_native_wan22_image_to_video_latent():
    """Hand-computed: the encoded frame raw in latent frame 0, the latent mean (an empty latent, normalised: 0)
    in the others, the mask 0 on frame 0, both repeated to the batch; without a start image one empty row."""
    encoded = torch.full((1, 48, 1, 3, 4), 2.0)
    latent = wan22_image_latent(encoded, 64, 48, 9, 2)
    samples, mask = latent["samples"], latent["noise_mask"]
    assert samples.shape == (2, 48, 3, 3, 4) and mask.shape == (2, 1, 3, 3, 4)
    assert torch.equal(samples[:, :, 0], torch.full((2, 48, 3, 4), 2.0))
    mean = torch.tensor(WAN22_LATENTS_MEAN).view(1, -1, 1, 1)
    assert torch.equal(samples[:, :, 1], mean.expand(2, -1, 3, 4)) and torch.equal(samples[:, :, 2], samples[:, :, 1])
    assert mask[:, :, 0].eq(0).all() and mask[:, :, 1:].eq(1).all()
    empty = wan22_image_latent(None, 64, 48, 9, 2)
    assert list(empty) == ["samples"] and torch.equal(empty["samples"], torch.zeros(1, 48, 3, 3, 4))
    with pytest.raises(ValueError, match=r"expected \[1, 48, at most 3, 3, 4\]"):
        wan22_image_latent(torch.zeros(1, 16, 1, 6, 8), 64, 48, 9, 1)
    with pytest.raises(ValueError, match="width 72 is not a positive multiple of 16"):
        wan22_image_latent(None, 72, 48, 9, 1)


def test_start_frames_are_cut_to_the_length_and_fitted():
    start = torch.rand(12, 30, 60, 4)  # RGBA, wider than 64 x 48: center-cropped
    frames = wan22_start_frames(start, 64, 48, 9)
    assert frames.shape == (9, 48, 64, 3)
    assert wan22_start_frames(None, 64, 48, 9) is None


def test_noise_mask_resizing_and_per_frame_timesteps_by_hand():
    """SetLatentNoiseMask's [F, 1, H, W] at twice the latent size: each latent position the mean of its 2 x 2 pixels
    (trilinear, half-pixel centres), every channel and row alike; the timestep of a frame its mean times t."""
    pixels = torch.tensor([[[[0.0, 1.0], [1.0, 1.0]]], [[[1.0, 1.0], [1.0, 1.0]]]])  # [2, 1, 2, 2]
    mask = latent_noise_mask(pixels, (2, 48, 2, 1, 1))
    assert mask.shape == (2, 48, 2, 1, 1)
    assert mask[:, :, 0].eq(0.75).all() and mask[:, :, 1].eq(1.0).all()
    assert torch.equal(frame_timesteps(mask, torch.tensor([800.0])), torch.tensor([[600.0, 800.0]] * 2))
    half = torch.ones(1, 48, 2, 2, 2)
    half[:, :, 1, 0] = 0.0  # half of frame 1's positions kept
    assert torch.equal(frame_timesteps(half, torch.tensor([500.0])), torch.tensor([[500.0, 250.0]]))


def test_per_frame_timesteps_spread_over_each_frames_tokens():
    """3 x 4 latents in 2 x 2 patches: the height is padded to 4, so each frame has 2 x 2 = 4 tokens."""
    tokens = token_timesteps(torch.tensor([[0.0, 900.0]]), (1, 48, 2, 3, 4), (1, 2, 2))
    assert torch.equal(tokens, torch.tensor([[0.0] * 4 + [900.0] * 4]))


def test_the_native_model_sends_per_frame_timesteps_as_given():
    x = torch.zeros(2, *SHAPE[1:])
    assert torch.equal(call_timesteps(torch.tensor([[0.0, 5.0, 5.0]] * 2), x), torch.tensor([[0.0, 5.0, 5.0]] * 2))
    assert torch.equal(call_timesteps(torch.tensor([7.0]), x), torch.tensor([7.0, 7.0]))


class HalfFlow(torch.nn.Module):
    """A TI2V stand-in whose flow prediction is half its input; it records each call's input and timesteps."""

    config = SimpleNamespace(in_channels=48, out_channels=48, patch_size=(1, 2, 2), text_dim=8)

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kwargs):
        self.calls.append((hidden_states.clone(), timestep.clone()))
        return (0.5 * hidden_states,)


def _masked_request(**overrides) -> SampleRequest:
    encoded = torch.randn(1, 48, 1, 3, 4, generator=torch.Generator().manual_seed(1))
    latent = wan22_image_latent(encoded, 64, 48, 9, 1)
    fields = dict(handle="h", latent=latent["samples"], positive=[torch.zeros(4, 8)], negative=[torch.zeros(4, 8)],
                  seed=3, steps=1, guidance_scale=1.0, shift=5.0, sampler="euler", noise_mask=latent["noise_mask"])
    return SampleRequest(**{**fields, **overrides})


def test_one_euler_step_keeps_the_start_frame_as_comfyui_by_hand():
    """One euler step (sigmas 1, 0) by hand, as ComfyUI's KSamplerX0Inpaint runs it: the model input is the noise
    with the kept frame replaced by the start latent, its timesteps 0 on that frame's tokens and 1000 on the others;
    the result is the denoised estimate (input - sigma x flow = half the input) with the kept frame replaced again."""
    model = HalfFlow()
    request = _masked_request()
    out = sample(model, request)
    start = normalize_latents(request.latent)
    noise = torch.randn(request.latent.shape, generator=torch.Generator().manual_seed(request.seed))
    model_input = noise.clone()
    model_input[:, :, 0] = start[:, :, 0]
    (given, timestep), = model.calls
    torch.testing.assert_close(given, model_input, rtol=0, atol=1e-6)
    assert torch.equal(timestep, torch.tensor([[0.0] * 4 + [1000.0] * 8]))
    expected = 0.5 * model_input
    expected[:, :, 0] = start[:, :, 0]
    torch.testing.assert_close(out, denormalize_latents(expected), rtol=0, atol=1e-5)


@pytest.mark.parametrize("sampler", ["wan_unipc", "unipc"])
def test_wan_unipc_keeps_the_start_frame_as_wan22s_own_ti2v_code_by_hand(sampler):
    """Wan 2.2's own TI2V image-to-video loop by hand (its flow UniPC is diffusers' UniPC on flow sigmas): the start
    noise with the kept frame replaced by the start latent, each call's timesteps the mask times t (0 on the kept
    frame's tokens), each step's result with the kept frame replaced again."""
    model = HalfFlow()
    request = _masked_request(sampler=sampler, steps=3)
    out = sample(model, request)
    start = normalize_latents(request.latent)
    mask = torch.ones_like(start)
    mask[:, :, 0] = 0.0
    noise = torch.randn(request.latent.shape, generator=torch.Generator().manual_seed(request.seed))
    latent = (1.0 - mask) * start + mask * noise
    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=request.shift)
    scheduler.set_timesteps(request.steps)
    assert len(model.calls) == len(scheduler.timesteps) == 3
    for (given, timestep), t in zip(model.calls, scheduler.timesteps):
        torch.testing.assert_close(given, latent, rtol=0, atol=1e-5)
        assert torch.equal(timestep, torch.tensor([[0.0] * 4 + [float(t)] * 8]))
        latent = scheduler.step(0.5 * latent, t, latent, return_dict=False)[0]
        latent = (1.0 - mask) * start + mask * latent
    torch.testing.assert_close(out, denormalize_latents(latent), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[:, :, 0], request.latent[:, :, 0], rtol=0, atol=1e-5)  # the start image's latent frame comes back as given


def test_without_the_mask_every_frame_is_sampled_at_one_timestep():
    model = HalfFlow()
    sample(model, _masked_request(noise_mask=None))
    (_, timestep), = model.calls
    assert torch.equal(timestep, torch.tensor([1000.0]))


def test_mismatched_latents_and_models_are_refused(tiny_models):
    ti2v = load_transformer(str(tiny_models["ti2v"]))
    assert (ti2v.config.in_channels, ti2v.config.out_channels) == (NATIVE_TI2V["in_channels"], 48)
    request = _masked_request(latent=torch.zeros(1, 16, 3, 6, 8), noise_mask=None)
    with pytest.raises(ValueError, match="the latent has 16 channels but this model samples 48-channel latents"):
        sample(ti2v, request)


def test_per_frame_timesteps_of_one_value_equal_one_timestep_per_row(tiny_models):
    """The tiny TI2V (loaded from its file): per-token timesteps all equal to t give the one-timestep result; a
    kept frame (timestep 0) changes it."""
    ti2v = load_transformer(str(tiny_models["ti2v"]))
    generator = torch.Generator().manual_seed(2)
    latent, context = torch.randn(1, *SHAPE[1:], generator=generator), torch.randn(1, 512, 4096, generator=generator)

    def call(timestep):
        return forward_rows(ti2v, ModelForward(handle="h", latent=latent, timestep=timestep, context=context),
                            range(1), torch.float32, "cpu")

    one = call(torch.tensor([700.0]))
    torch.testing.assert_close(call(torch.tensor([[700.0] * 3])), one, rtol=0, atol=1e-5)
    assert (call(torch.tensor([[0.0, 700.0, 700.0]])) - one).abs().max() > 1e-3


def test_the_node_encodes_the_fitted_start_on_the_pool_and_returns_the_native_latent():
    from wanmesh.nodes.ti2v import WanMeshWan22ImageToVideoLatent

    encoded = torch.randn(1, 48, 1, 3, 4, generator=torch.Generator().manual_seed(4))
    calls = []

    class Runner:
        def encode(self, handle, frames):
            calls.append((handle, frames))
            return encoded

    vae = SimpleNamespace(runner=Runner(), handle="vae22")
    start = torch.rand(2, 40, 40, 3)
    (latent,) = WanMeshWan22ImageToVideoLatent().encode(vae, 64, 48, 9, 2, start_image=start)
    (handle, frames), = calls
    assert handle == "vae22" and torch.equal(frames, wan22_start_frames(start, 64, 48, 9))
    expected = wan22_image_latent(encoded, 64, 48, 9, 2)
    assert set(latent) == {"samples", "noise_mask"}
    assert all(torch.equal(latent[key], expected[key]) for key in expected)
    (empty,) = WanMeshWan22ImageToVideoLatent().encode(vae, 64, 48, 9, 2)
    assert len(calls) == 1 and torch.equal(empty["samples"], torch.zeros(1, 48, 3, 3, 4))
