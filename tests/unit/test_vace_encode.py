"""The native VACE conditioning format: against diffusers' WanVACEPipeline preprocessing, against an independent
re-implementation of the native format (ComfyUI's WanVaceToVideo / WAN21_Vace, as docs/models.md's VACE section states it), and known answers; CPU, tiny VAE."""

from __future__ import annotations

import math

import numpy as np
import PIL.Image
import pytest
import torch

from wanmesh.parallel.vace.context import default_vace_context, vace_model_context
from wanmesh.parallel.vace.encode import (
    check_encode_inputs, control_inputs, encode_vace, fit_to_canvas, fold_mask, split_inactive_reactive,
)

WIDTH, HEIGHT = 48, 32


@pytest.fixture(scope="module")
def vae(tiny_reference):
    return tiny_reference.vae


@pytest.fixture(scope="module")
def latent_stats(vae):
    return torch.tensor(vae.config.latents_mean), torch.tensor(vae.config.latents_std)


@pytest.fixture(scope="module")
def encode_frames(vae):
    """The caller-supplied VAE encode: `[F,H,W,3]` in 0..1 -> raw latents `[1,16,T,h,w]` (posterior mode)."""
    def encode(frames: torch.Tensor) -> torch.Tensor:
        video = frames.permute(3, 0, 1, 2).unsqueeze(0) * 2 - 1
        with torch.no_grad():
            return vae.encode(video).latent_dist.mode()
    return encode


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- an independent reading of the documented native format (ComfyUI's WanVaceToVideo) -----------------

def comfy_centre_fit(images_chw: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """ComfyUI's common_upscale(..., "bilinear", "center") on `[N, C, H, W]`: symmetric crop, then resize."""
    old_height, old_width = images_chw.shape[2], images_chw.shape[3]
    old_aspect, new_aspect = old_width / old_height, width / height
    crop_x = round((old_width - old_width * (new_aspect / old_aspect)) / 2) if old_aspect > new_aspect else 0
    crop_y = round((old_height - old_height * (old_aspect / new_aspect)) / 2) if old_aspect < new_aspect else 0
    kept = images_chw.narrow(2, crop_y, old_height - 2 * crop_y).narrow(3, crop_x, old_width - 2 * crop_x)
    return torch.nn.functional.interpolate(kept, size=(height, width), mode="bilinear")


def fold_by_offsets(mask: torch.Tensor, latent_frames: int) -> torch.Tensor:
    """[F,H,W] -> [64,T,h,w]: channel dy*8+dx holds pixel (8i+dy, 8j+dx); frames picked nearest-exact."""
    frames = mask.shape[0]
    planes = torch.stack([mask[:, dy::8, dx::8] for dy in range(8) for dx in range(8)])
    picks = [min(math.floor((t + 0.5) * frames / latent_frames), frames - 1) for t in range(latent_frames)]
    return planes[:, picks]


def native_reference(encode, width, height, length, latents_mean, video=None, masks=None, reference=None):
    """(vace_frames, vace_mask, trim_latent) the way WanVaceToVideo is documented; one reference at most."""
    latent_frames = (length - 1) // 4 + 1
    canvas_video = torch.full((length, height, width, 3), 0.5)
    if video is not None:
        fitted = comfy_centre_fit(video[:length].movedim(-1, 1), width, height).movedim(1, -1)
        canvas_video[:fitted.shape[0]] = fitted[..., :3]
    canvas_mask = torch.ones((length, height, width))
    if masks is not None:
        fitted = comfy_centre_fit(masks[:length].unsqueeze(1), width, height)[:, 0]
        canvas_mask[:fitted.shape[0]] = fitted
    keep = 1 - canvas_mask.unsqueeze(-1)
    inactive = (canvas_video - 0.5) * keep + 0.5
    reactive = (canvas_video - 0.5) * (1 - keep) + 0.5
    vace_frames = torch.cat([encode(inactive), encode(reactive)], dim=1)
    vace_mask = fold_by_offsets(canvas_mask, latent_frames)
    if reference is None:
        return vace_frames, vace_mask.unsqueeze(0), 0
    reference_pixels = comfy_centre_fit(reference[:1].movedim(-1, 1), width, height).movedim(1, -1)[..., :3]
    reference_latent = encode(reference_pixels)
    zero_normalised = torch.ones_like(reference_latent) * latents_mean.view(1, 16, 1, 1, 1)
    reference_frame = torch.cat([reference_latent, zero_normalised], dim=1)
    vace_frames = torch.cat([reference_frame, vace_frames], dim=2)
    vace_mask = torch.cat([torch.zeros_like(vace_mask[:, :1]), vace_mask], dim=1)
    return vace_frames, vace_mask.unsqueeze(0), 1


# --- canvas fitting --------------------------------------------------------------------------------

@pytest.mark.parametrize("source_hw", [(30, 50), (40, 36), (24, 36), (16, 24), (17, 61), (64, 96)])
def test_fit_to_canvas_matches_common_upscale_bit_for_bit(source_hw):
    frames = torch.rand(3, *source_hw, 4, generator=generator(1))
    expected = comfy_centre_fit(frames.movedim(-1, 1), WIDTH, HEIGHT).movedim(1, -1)
    assert torch.equal(fit_to_canvas(frames, WIDTH, HEIGHT), expected)


def test_fit_to_canvas_crop_rounds_half_to_even():
    """Hand computation: 50x30 onto 48x16 (aspect 3) keeps 30 * (5/3) / 3 = 16.67 rows, cutting
    (30 - 16.67) / 2 = 6.67 -> 7 rows each side; 40x30 onto 16x16 cuts (40 - 30) / 2 = 5 columns; the half
    case 20x10 onto 48x32 cuts (20 - 15) / 2 = 2.5 -> 2 columns (Python's round, half to even).
    """
    cases = [((30, 50), (48, 16), (7, 0)), ((30, 40), (16, 16), (0, 5)), ((10, 20), (48, 32), (0, 2))]
    for (source_h, source_w), (width, height), (cut_y, cut_x) in cases:
        image = torch.rand(1, source_h, source_w, 3, generator=generator(2))
        kept = image[:, cut_y:source_h - cut_y, cut_x:source_w - cut_x].permute(0, 3, 1, 2)
        expected = torch.nn.functional.interpolate(kept, size=(height, width), mode="bilinear").permute(0, 2, 3, 1)
        assert torch.allclose(fit_to_canvas(image, width, height), expected, atol=1e-6)


def test_control_inputs_defaults_and_padding():
    video, mask = control_inputs(WIDTH, HEIGHT, 9)
    assert video.shape == (9, HEIGHT, WIDTH, 3) and torch.all(video == 0.5)
    assert mask.shape == (9, HEIGHT, WIDTH) and torch.all(mask == 1)
    short_video = torch.rand(3, 20, 30, 3, generator=generator(3))
    short_mask = torch.zeros(3, 20, 30)
    video, mask = control_inputs(WIDTH, HEIGHT, 9, short_video, short_mask)
    assert torch.all(video[3:] == 0.5) and torch.all(mask[3:] == 1) and torch.all(mask[:3] == 0)
    assert not torch.all(video[:3] == 0.5)


# --- mask folding and inactive/reactive ------------------------------------------------------------

def test_fold_mask_places_a_single_pixel():
    """Pixel (frame 4, y 11, x 5): block (1, 0), offset (3, 5) -> channel 29; nearest-exact 9 -> 3 frames
    samples frames 1, 4, 7, so frame 4 lands on latent frame 1 and frame 3 vanishes."""
    mask = torch.zeros(9, 16, 24)
    mask[4, 11, 5] = 1
    folded = fold_mask(mask, 3)
    assert folded.shape == (64, 3, 2, 3)
    assert folded.sum() == 1 and folded[29, 1, 1, 0] == 1
    mask = torch.zeros(9, 16, 24)
    mask[3, 0, 0] = 1
    assert fold_mask(mask, 3).sum() == 0


def test_inactive_ignores_the_video_under_an_all_ones_mask():
    video = torch.rand(5, 16, 16, 3, generator=generator(4))
    inactive, reactive = split_inactive_reactive(video, torch.ones(5, 16, 16))
    assert torch.all(inactive == 0.5)
    assert torch.allclose(reactive, video, atol=1e-7)
    inactive, reactive = split_inactive_reactive(video, torch.zeros(5, 16, 16))
    assert torch.all(reactive == 0.5) and torch.allclose(inactive, video, atol=1e-7)


# --- against the documented native format ----------------------------------------------------------

NATIVE_CASES = {
    # non-canvas video (crop x), fewer frames than length, taller mask (crop y), RGBA reference off-canvas
    "crop_pad_reference": dict(length=9, video=(5, 28, 50, 3), masks=(5, 40, 36), reference=(1, 64, 40, 4)),
    "mask_only": dict(length=5, video=None, masks=(2, 32, 48), reference=None),
    "defaults": dict(length=5, video=None, masks=None, reference=None),
    "longer_than_length": dict(length=9, video=(11, 32, 48, 3), masks=(13, 16, 24), reference=(2, 32, 48, 3)),
}


@pytest.mark.parametrize("case", NATIVE_CASES.keys())
def test_encode_vace_matches_native_format(case, encode_frames, latent_stats):
    spec = NATIVE_CASES[case]
    video = torch.rand(*spec["video"], generator=generator(5)) if spec["video"] else None
    masks = torch.rand(*spec["masks"], generator=generator(6)) if spec["masks"] else None
    reference = torch.rand(*spec["reference"], generator=generator(7)) if spec["reference"] else None
    mean = latent_stats[0]
    native_frames, native_mask, native_trim = native_reference(
        encode_frames, WIDTH, HEIGHT, spec["length"], mean, video, masks, reference)
    first_reference = reference[:1] if reference is not None else None
    encoding = encode_vace(encode_frames, WIDTH, HEIGHT, spec["length"], mean, video, masks, first_reference)
    latent_frames = (spec["length"] - 1) // 4 + 1 + native_trim
    assert encoding.frames.shape == (1, 32, latent_frames, HEIGHT // 8, WIDTH // 8)
    assert encoding.mask.shape == (1, 64, latent_frames, HEIGHT // 8, WIDTH // 8)
    assert encoding.trim_latent == native_trim
    assert torch.allclose(encoding.frames, native_frames, atol=1e-6)
    assert torch.allclose(encoding.mask, native_mask, atol=1e-7)


def test_several_references_prepend_in_order(encode_frames, latent_stats):
    mean = latent_stats[0]
    video = torch.rand(5, HEIGHT, WIDTH, 3, generator=generator(8))
    references = torch.rand(2, 40, 40, 3, generator=generator(9))
    plain = encode_vace(encode_frames, WIDTH, HEIGHT, 5, mean, control_video=video)
    encoding = encode_vace(encode_frames, WIDTH, HEIGHT, 5, mean, control_video=video, reference_images=references)
    assert encoding.trim_latent == 2 and encoding.frames.shape[2] == 2 + plain.frames.shape[2]
    for index in range(2):
        alone = comfy_centre_fit(references[index:index + 1].movedim(-1, 1), WIDTH, HEIGHT).movedim(1, -1)
        assert torch.allclose(encoding.frames[:, :16, index:index + 1], encode_frames(alone), atol=1e-6)
    assert torch.allclose(encoding.frames[:, 16:, :2], mean.view(1, 16, 1, 1, 1).expand(1, 16, 2, 4, 6))
    assert torch.all(encoding.mask[:, :, :2] == 0)
    assert torch.allclose(encoding.frames[:, :, 2:], plain.frames, atol=1e-6)
    assert torch.equal(encoding.mask[:, :, 2:], plain.mask)


# --- against diffusers' WanVACEPipeline -------------------------------------------------------------

@pytest.fixture(scope="module")
def diffusers_pipeline(tiny_reference):
    from diffusers import WanVACEPipeline

    return WanVACEPipeline(tokenizer=None, text_encoder=None, vae=tiny_reference.vae, scheduler=None,
                           transformer=tiny_reference.vace)


@pytest.mark.parametrize("reference_count", [0, 1, 2])
def test_model_input_matches_diffusers(reference_count, diffusers_pipeline, encode_frames, latent_stats):
    """Canvas-sized inputs (diffusers pads references with white where native crops) and a binary mask
    (diffusers thresholds the mask at 0.5). diffusers prepends each reference in turn, so the last given ends
    up first: it gets the references reversed to produce the order WanMesh (and the official VACE) uses."""
    length, device = 9, torch.device("cpu")
    video = torch.rand(length, HEIGHT, WIDTH, 3, generator=generator(10))
    mask = (torch.rand(length, HEIGHT, WIDTH, generator=generator(11)) > 0.5).float()
    pixels = torch.randint(0, 256, (reference_count, HEIGHT, WIDTH, 3), generator=generator(12), dtype=torch.uint8)
    references = [PIL.Image.fromarray(np.ascontiguousarray(image.numpy())) for image in pixels]
    pipe = diffusers_pipeline
    with torch.no_grad():
        video_d, mask_d, references_d = pipe.preprocess_conditions(
            video.permute(0, 3, 1, 2).unsqueeze(0), mask[None, :, None], references[::-1] or None,
            batch_size=1, height=HEIGHT, width=WIDTH, num_frames=length, dtype=torch.float32, device=device)
        latents_d = pipe.prepare_video_latents(video_d, mask_d, references_d, device=device)
        mask_folded_d = pipe.prepare_masks(mask_d, references_d)
    diffusers_context = torch.cat([latents_d, mask_folded_d], dim=1)

    mean, std = latent_stats
    encoding = encode_vace(encode_frames, WIDTH, HEIGHT, length, mean, control_video=video, control_masks=mask,
                           reference_images=pixels.float() / 255 if reference_count else None)
    context = vace_model_context([encoding.frames], [encoding.mask], mean, std)
    assert context.shape == (1, 1, 96, reference_count + 3, HEIGHT // 8, WIDTH // 8)
    assert encoding.trim_latent == reference_count
    assert torch.allclose(context[:, 0], diffusers_context, atol=1e-5, rtol=1e-5)


# --- model context -----------------------------------------------------------------------------------

def test_vace_model_context_normalises_each_context(latent_stats):
    mean, std = latent_stats
    frames = [torch.randn(1, 32, 3, 2, 3, generator=generator(13)), torch.randn(2, 32, 3, 2, 3, generator=generator(14))]
    masks = [torch.rand(1, 64, 3, 2, 3, generator=generator(15)), torch.rand(1, 64, 3, 2, 3, generator=generator(16))]
    context = vace_model_context(frames, masks, mean, std)
    assert context.shape == (2, 2, 96, 3, 2, 3)
    for j in range(2):
        for b in range(2):
            source = frames[j][min(b, frames[j].shape[0] - 1)]
            for channel in range(32):
                expected = (source[channel] - mean[channel % 16]) / std[channel % 16]
                assert torch.allclose(context[b, j, channel], expected, atol=1e-6)
            assert torch.equal(context[b, j, 32:], masks[j][0])


def test_default_vace_context_is_normalised_raw_zeros_and_ones_mask(latent_stats):
    mean, std = latent_stats
    context = default_vace_context(2, 3, 2, 4, mean, std)
    assert context.shape == (2, 1, 96, 3, 2, 4)
    expected_latent = (-mean / std).view(16, 1, 1, 1).expand(16, 3, 2, 4)
    assert torch.allclose(context[:, 0, :16], expected_latent.expand(2, -1, -1, -1, -1), atol=1e-6)
    assert torch.allclose(context[:, 0, 16:32], expected_latent.expand(2, -1, -1, -1, -1), atol=1e-6)
    assert torch.all(context[:, 0, 32:] == 1)


# --- input checks ------------------------------------------------------------------------------------

BAD_INPUTS = {
    "width": (dict(width=100), "width 100"),
    "height": (dict(height=8), "height 8"),
    "length_not_4k_plus_1": (dict(length=10), "length 10"),
    "length_zero": (dict(length=0), "length 0"),
    "mask_above_one": (dict(control_masks=torch.full((5, 16, 16), 1.5)), "1.5"),
    "mask_below_zero": (dict(control_masks=torch.full((5, 16, 16), -0.25)), "-0.25"),
    "mask_shape": (dict(control_masks=torch.ones(5, 16, 16, 1)), "(5, 16, 16, 1)"),
    "reference_channels": (dict(reference_images=torch.rand(1, 16, 16, 2)), "(1, 16, 16, 2)"),
    "video_channels": (dict(control_video=torch.rand(5, 16, 16, 1)), "(5, 16, 16, 1)"),
}


@pytest.mark.parametrize("name", BAD_INPUTS.keys())
def test_bad_inputs_raise_one_line_value_errors_before_encoding(name, latent_stats):
    changes, named_value = BAD_INPUTS[name]
    arguments = dict(width=WIDTH, height=HEIGHT, length=9, control_video=None, control_masks=None,
                     reference_images=None) | changes
    with pytest.raises(ValueError) as raised:
        check_encode_inputs(**arguments)
    message = str(raised.value)
    assert named_value in message and "\n" not in message

    def encode_must_not_run(frames):
        raise AssertionError("VAE encode ran before the input check")

    with pytest.raises(ValueError):
        encode_vace(encode_must_not_run, latents_mean=latent_stats[0], **arguments)


def test_frame_counts_that_differ_from_each_other_and_from_length_are_accepted_as_native_does():
    check_encode_inputs(WIDTH, HEIGHT, 9, torch.rand(5, 16, 16, 3), torch.ones(3, 16, 16), None)
    check_encode_inputs(WIDTH, HEIGHT, 9, torch.rand(11, 16, 16, 3), torch.ones(13, 16, 16), None)


def test_control_video_and_masks_of_other_frame_counts_are_cut_or_padded_as_native():
    """Native WanVaceToVideo cuts each to length and pads each on its own: the video with grey, the masks with ones."""
    from wanmesh.parallel.vace.encode import control_inputs, frame_count_changes

    video, masks = torch.rand(3, 16, 16, 3), torch.zeros(12, 16, 16)
    padded_video, cut_masks = control_inputs(16, 16, 9, video, masks)
    assert padded_video.shape == (9, 16, 16, 3) and cut_masks.shape == (9, 16, 16)
    assert torch.equal(padded_video[:3], video) and torch.all(padded_video[3:] == 0.5)
    assert torch.all(cut_masks == 0)
    _, padded_masks = control_inputs(16, 16, 9, None, torch.zeros(4, 16, 16))
    assert torch.all(padded_masks[:4] == 0) and torch.all(padded_masks[4:] == 1)
    assert frame_count_changes(9, video, masks) == [
        "the control video has 3 frames: padded to 9 with grey frames",
        "the control masks have 12 frames: cut to the first 9"]
    assert frame_count_changes(9, torch.rand(9, 16, 16, 3), None) == []
