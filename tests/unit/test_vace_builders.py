"""VACE input builders (parallel/vace/builders.py) and their ComfyUI nodes: tiny CPU tensors, references written
independently in the test (numpy slicing, hand-computed boxes, a hand-written RGB->hue)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from wanmesh.nodes import vace_builders as vace_nodes
from wanmesh.parallel.vace import builders as vb


def _video(frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(frames, height, width, 3, generator=torch.Generator().manual_seed(seed))


def _box_reference(height: int, width: int, x: int, y: int, w: int, h: int) -> np.ndarray:
    """A 0/1 mask with the box written by slicing (clipped by numpy's slice bounds)."""
    mask = np.zeros((height, width), dtype=np.float32)
    mask[max(y, 0):max(y + h, 0), max(x, 0):max(x + w, 0)] = 1.0
    return mask


def _texture(size: int, seed: int = 0) -> torch.Tensor:
    """Smooth random texture [size, size] in 0..1 (blurred noise: well-conditioned for optical flow)."""
    noise = torch.rand(1, 1, size, size, generator=torch.Generator().manual_seed(seed))
    smooth = F.avg_pool2d(noise, 5, stride=1, padding=2, count_include_pad=False)[0, 0]
    return (smooth - smooth.min()) / (smooth.max() - smooth.min())


def _hue_degrees(rgb: np.ndarray) -> np.ndarray:
    """Hue in degrees of RGB pixels (the hexcone formula, written out here independently of OpenCV)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    return np.degrees(np.arctan2(np.sqrt(3.0) * (g - b), 2.0 * r - g - b)) % 360.0


def _circular_distance(angles: np.ndarray, target: float) -> np.ndarray:
    return np.abs((angles - target + 180.0) % 360.0 - 180.0)


# ------------------------------------------------------------------------------------------------- masks


def test_inpaint_greys_masked_pixels_and_broadcasts_a_single_mask():
    video = _video(5, 16, 16)
    mask = (torch.rand(1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.5).float()
    control, masks = vb.inpaint_from_mask(video, mask)
    assert masks.shape == (5, 16, 16) and torch.equal(masks, mask.expand(5, 16, 16))
    masked = mask.expand(5, 16, 16).bool()
    assert torch.all(control[masked] == 0.5)
    assert torch.equal(control[~masked], video[~masked])


def test_inpaint_soft_mask_blends_towards_grey():
    video = _video(1, 8, 16)
    control, _ = vb.inpaint_from_mask(video, torch.full((1, 8, 16), 0.25))
    torch.testing.assert_close(control, 0.75 * video + 0.125)


def test_box_mask_static_box_has_exactly_the_box():
    control, masks = vb.box_mask(32, 32, 5, (3, 5, 7, 4))
    expected = torch.from_numpy(_box_reference(32, 32, 3, 5, 7, 4))
    for frame in masks:
        assert int(frame.sum()) == 7 * 4
        assert torch.equal(frame, expected)
    assert torch.all(control == 0.5)  # no video: all grey


def test_box_mask_moves_linearly_to_the_end_box():
    start, end = (0, 0, 4, 4), (20, 12, 8, 6)
    _, masks = vb.box_mask(32, 32, 9, start, end)
    assert torch.equal(masks[0], torch.from_numpy(_box_reference(32, 32, *start)))
    assert torch.equal(masks[-1], torch.from_numpy(_box_reference(32, 32, *end)))
    middle = (10, 6, 6, 5)  # halfway between start and end, by hand
    assert torch.equal(masks[4], torch.from_numpy(_box_reference(32, 32, *middle)))
    assert int(masks[4].sum()) == 6 * 5


def test_box_mask_rounds_intermediate_positions_to_whole_pixels():
    _, masks = vb.box_mask(16, 16, 5, (0, 0, 4, 4), (3, 0, 4, 4))
    # x = 3 * t for t = 0, 1/4, 1/2, 3/4, 1 -> 0, 0.75, 1.5, 2.25, 3 -> rounded (halves up) 0, 1, 2, 2, 3
    for frame, x in zip(masks, (0, 1, 2, 2, 3)):
        assert torch.equal(frame, torch.from_numpy(_box_reference(16, 16, x, 0, 4, 4)))


def test_box_mask_clips_to_the_canvas_and_greys_a_given_video():
    video = _video(5, 16, 16)
    control, masks = vb.box_mask(16, 16, 5, (-2, -3, 6, 6), video=video)
    assert int(masks[0].sum()) == 4 * 3
    assert torch.equal(masks[0], torch.from_numpy(_box_reference(16, 16, -2, -3, 6, 6)))
    inside = masks.bool()
    assert torch.all(control[inside] == 0.5)
    assert torch.equal(control[~inside], video[~inside])


def test_outpaint_places_the_video_inside_grey_padding():
    video = _video(5, 16, 16)
    control, masks = vb.outpaint(video, 8, 0, 8, 16)
    assert control.shape == (5, 32, 32, 3) and masks.shape == (5, 32, 32)
    assert torch.equal(control[:, 0:16, 8:24], video)
    assert torch.all(masks[:, 0:16, 8:24] == 0)
    padding = torch.ones(32, 32, dtype=torch.bool)
    padding[0:16, 8:24] = False
    assert torch.all(control[:, padding] == 0.5)
    assert torch.all(masks[:, padding] == 1)


def test_extend_keeps_frames_exactly_and_greys_the_new_ones():
    video = _video(5, 8, 16)
    control, masks = vb.extend(video, 13, keep_first=2, keep_last=3)
    assert control.shape == (13, 8, 16, 3)
    assert torch.equal(control[:2], video[:2])
    assert torch.equal(control[10:], video[2:5])
    assert torch.all(control[2:10] == 0.5)
    expected_mask = torch.tensor([0, 0] + [1] * 8 + [0, 0, 0], dtype=torch.float32)
    assert torch.equal(masks, expected_mask[:, None, None].expand(13, 8, 16))


def test_first_last_frame_sets_the_ends_and_greys_between():
    first, last = _video(1, 8, 16, seed=1), _video(1, 8, 16, seed=2)
    control, masks = vb.first_last_frame(first, last, 9)
    assert torch.equal(control[0], first[0]) and torch.equal(control[-1], last[0])
    assert torch.all(control[1:-1] == 0.5)
    assert torch.equal(masks[:, 0, 0], torch.tensor([0.0] + [1.0] * 7 + [0.0]))
    control, masks = vb.first_last_frame(first, None, 5)
    assert torch.equal(control[0], first[0]) and torch.all(control[1:] == 0.5)
    assert torch.equal(masks[:, 0, 0], torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0]))


# ------------------------------------------------------------------------------------------------- references


def test_reference_fully_transparent_rgba_becomes_white():
    image = torch.cat([_video(1, 16, 16), torch.zeros(1, 16, 16, 1)], dim=-1)
    assert torch.equal(vb.reference_images(image, 32, 16), torch.ones(1, 16, 32, 3))


def test_reference_alpha_mask_overrides_the_alpha_channel():
    colour = torch.tensor([0.2, 0.4, 0.6])
    image = torch.cat([colour.expand(1, 16, 16, 3), torch.ones(1, 16, 16, 1)], dim=-1)
    out = vb.reference_images(image, 16, 16, alpha=torch.full((1, 16, 16), 0.5))
    torch.testing.assert_close(out, (0.5 * colour + 0.5).expand(1, 16, 16, 3))


@pytest.mark.parametrize("image_hw, canvas_wh, fitted_rows, fitted_cols", [
    ((16, 8), (32, 32), (0, 32), (8, 24)),     # tall image: full height, centred horizontally
    ((8, 16), (32, 48), (16, 32), (0, 32)),    # wide image: full width, centred vertically
    ((8, 16), (64, 32), (0, 32), (0, 64)),     # same aspect ratio: fills the canvas
])
def test_reference_fits_inside_keeping_the_aspect_ratio(image_hw, canvas_wh, fitted_rows, fitted_cols):
    colour = torch.tensor([0.2, 0.4, 0.6])
    image = colour.expand(1, *image_hw, 3).contiguous()
    out = vb.reference_images(image, *canvas_wh)
    width, height = canvas_wh
    assert out.shape == (1, height, width, 3)
    expected = torch.ones(1, height, width, 3)
    expected[:, fitted_rows[0]:fitted_rows[1], fitted_cols[0]:fitted_cols[1]] = colour
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------------------------- controls


def test_canny_finds_the_border_of_a_white_square():
    video = torch.zeros(2, 32, 32, 3)
    video[:, 8:24, 8:24] = 1.0
    edges = vb.control_from_video(video, "canny")
    assert edges.shape == (2, 32, 32, 3)
    assert torch.equal(edges[..., 0], edges[..., 1]) and torch.equal(edges[..., 0], edges[..., 2])
    assert set(edges.unique().tolist()) <= {0.0, 1.0}
    on_edge = edges[0, ..., 0].bool().numpy()
    near_border = np.zeros((32, 32), dtype=bool)  # pixels within 1 of the square's boundary
    near_border[7:25, 7:25] = True
    near_border[10:22, 10:22] = False
    assert not np.any(on_edge & ~near_border), "edges away from the square's border"
    assert on_edge[7:25, 7:9].any() and on_edge[7:25, 23:25].any(), "left or right side missing"
    assert on_edge[7:9, 7:25].any() and on_edge[23:25, 7:25].any(), "top or bottom side missing"
    assert on_edge.sum() >= 4 * 14


def test_gray_is_the_bt601_luminance():
    video = _video(2, 8, 16)
    gray = vb.control_from_video(video, "gray")
    luminance = video[..., 0] * 0.299 + video[..., 1] * 0.587 + video[..., 2] * 0.114
    for channel in range(3):
        torch.testing.assert_close(gray[..., channel], luminance)


def test_scribble_is_a_thicker_superset_of_canny():
    video = torch.stack([_texture(48, 0), _texture(48, 1)], dim=0)[..., None].expand(-1, -1, -1, 3)
    canny = vb.control_from_video(video, "canny", low_threshold=20, high_threshold=60)
    scribble = vb.control_from_video(video, "scribble", low_threshold=20, high_threshold=60)
    assert canny.sum() > 0
    assert torch.all(scribble[canny > 0] > 0)
    assert (scribble > 0).sum() > (canny > 0).sum()


def _moving_texture(shift_rows: int, shift_cols: int, frames: int = 4, size: int = 64) -> torch.Tensor:
    texture = _texture(size)
    moved = [torch.roll(texture, shifts=(shift_rows * i, shift_cols * i), dims=(0, 1)) for i in range(frames)]
    return torch.stack(moved)[..., None].expand(-1, -1, -1, 3).contiguous()


@pytest.mark.parametrize("shift_rows, shift_cols, direction_degrees", [(0, 2, 0.0), (2, 0, 90.0), (0, -2, 180.0)])
def test_flow_hue_follows_the_motion_direction(shift_rows, shift_cols, direction_degrees):
    flow = vb.control_from_video(_moving_texture(shift_rows, shift_cols), "flow").numpy()
    interior = flow[:, 16:48, 16:48]  # away from the wrap-around seam of torch.roll
    hue = _hue_degrees(interior)
    assert np.mean(_circular_distance(hue, direction_degrees) < 15.0) > 0.9
    assert interior.max(axis=-1).mean() > 0.5  # moving pixels are bright
    np.testing.assert_array_equal(flow[0], flow[1])  # the first frame shows the second frame's flow


def test_flow_of_a_static_video_is_dark():
    static = _moving_texture(0, 0)
    flow = vb.control_from_video(static, "flow")
    assert flow.mean() < 0.01
    assert flow[:, 8:56, 8:56].max() < 0.1


def test_control_resize_centre_crops_then_resizes():
    video = _video(2, 32, 32)
    cropped = vb.control_from_video(video, "none", width=32, height=16)
    assert torch.equal(cropped, video[:, 8:24])  # centre crop, same scale: no resampling
    assert torch.equal(vb.control_from_video(video, "passthrough"), video)
    flat = torch.full((1, 64, 48, 3), 0.3)
    resized = vb.control_from_video(flat, "none", width=16, height=32)
    torch.testing.assert_close(resized, torch.full((1, 32, 16, 3), 0.3))


# ------------------------------------------------------------------------------------------------- errors


_V5 = _video(5, 16, 16)
ERROR_CASES = {
    "inpaint frame counts": (lambda: vb.inpaint_from_mask(_V5, torch.zeros(3, 16, 16)), ["3 frames", "5"]),
    "inpaint sizes": (lambda: vb.inpaint_from_mask(_V5, torch.zeros(5, 16, 8)), ["8x16"]),
    "inpaint mask above 1": (lambda: vb.inpaint_from_mask(_V5, torch.full((5, 16, 16), 1.5)), ["1.5"]),
    "inpaint mask below 0": (lambda: vb.inpaint_from_mask(_V5, torch.full((5, 16, 16), -0.25)), ["-0.25"]),
    "box outside": (lambda: vb.box_mask(32, 32, 5, (40, 0, 4, 4)), ["40", "32x32"]),
    "end box outside": (lambda: vb.box_mask(32, 32, 5, (0, 0, 4, 4), (0, -9, 4, 4)), ["-9"]),
    "box negative size": (lambda: vb.box_mask(32, 32, 5, (0, 0, -3, 4)), ["-3"]),
    "box zero size": (lambda: vb.box_mask(32, 32, 5, (0, 0, 4, 0)), ["4x0"]),
    "box canvas not 16": (lambda: vb.box_mask(40, 32, 5, (0, 0, 4, 4)), ["40", "32 or 48"]),
    "box length": (lambda: vb.box_mask(32, 32, 6, (0, 0, 4, 4)), ["6", "5 or 9"]),
    "outpaint size": (lambda: vb.outpaint(_V5, 3, 0, 0, 0), ["19x16", "pad_right 13"]),
    "outpaint negative": (lambda: vb.outpaint(_V5, 0, -2, 0, 2), ["pad_top", "-2"]),
    "extend keeps more than length": (lambda: vb.extend(_V5, 5, 4, 2), ["6", "length 5"]),
    "extend keeps more than the video": (lambda: vb.extend(_V5, 9, 4, 2), ["6", "only 5"]),
    "extend length": (lambda: vb.extend(_V5, 10, 1, 0), ["10", "9 or 13"]),
    "first_last length": (lambda: vb.first_last_frame(_V5[:1], None, 6), ["6", "5 or 9"]),
    "first_last sizes": (lambda: vb.first_last_frame(_V5[:1], _video(1, 16, 32), 5), ["32x16", "16x16"]),
    "first_last frames": (lambda: vb.first_last_frame(_V5, None, 5), ["5 frames"]),
    "reference channels": (lambda: vb.reference_images(torch.rand(1, 8, 8, 2), 16, 16), ["2 channels"]),
    "reference values": (lambda: vb.reference_images(torch.full((1, 8, 8, 3), 1.2), 16, 16), ["1.2"]),
    "reference alpha count": (lambda: vb.reference_images(torch.rand(3, 8, 8, 3), 16, 16, torch.ones(2, 8, 8)),
                              ["2 masks", "3 images"]),
    "reference alpha size": (lambda: vb.reference_images(torch.rand(1, 8, 8, 3), 16, 16, torch.ones(1, 8, 4)),
                             ["4x8"]),
    "reference alpha values": (lambda: vb.reference_images(torch.rand(1, 8, 8, 3), 16, 16,
                                                           torch.full((1, 8, 8), 2.5)), ["2.5"]),
    "control mode": (lambda: vb.control_from_video(_V5, "depth"), ["'depth'", "canny", "passthrough"]),
    "control width only": (lambda: vb.control_from_video(_V5, "gray", width=32), ["width 32", "height None"]),
    "control size not 16": (lambda: vb.control_from_video(_V5, "gray", 100, 32), ["100", "96 or 112"]),
    "control thresholds": (lambda: vb.control_from_video(_V5, "canny", low_threshold=300, high_threshold=200),
                           ["300", "200"]),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_bad_input_raises_a_one_line_value_error_naming_the_value(case):
    call, fragments = ERROR_CASES[case]
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# ------------------------------------------------------------------------------------------------- nodes


NODE_CLASSES = (vace_nodes.WanMeshVaceMask, vace_nodes.WanMeshVaceReference, vace_nodes.WanMeshVaceControl)


def test_node_module_does_not_import_comfyui():
    assert not any(name in ("comfy", "folder_paths", "nodes") or name.startswith("comfy.") for name in sys.modules)


@pytest.mark.parametrize("node_class", NODE_CLASSES, ids=lambda cls: cls.__name__)
def test_node_input_types_are_well_formed(node_class):
    spec = node_class.INPUT_TYPES()
    assert set(spec) == {"required", "optional"}
    for name, entry in {**spec["required"], **spec["optional"]}.items():
        kind, options = entry
        assert isinstance(kind, (str, list)), name
        assert options.get("tooltip"), f"{name} has no tooltip"
        if name in ("width", "height"):
            assert options["step"] == 16
        if name == "length":
            assert options["step"] == 4 and options["min"] == 1
        if kind == "INT":
            assert options["min"] <= options["default"] <= options["max"], name
        if isinstance(kind, list):
            assert options["default"] in kind
    assert len(node_class.RETURN_TYPES) == len(node_class.RETURN_NAMES)
    assert callable(getattr(node_class, node_class.FUNCTION))
    assert node_class.CATEGORY == "WanMesh/vace" and node_class.DESCRIPTION


def _assert_same(node_result, builder_result):
    assert len(node_result) == len(builder_result)
    for got, expected in zip(node_result, builder_result):
        assert torch.equal(got, expected)


def test_mask_node_matches_the_builders():
    node = vace_nodes.WanMeshVaceMask()
    video, mask = _video(5, 16, 16), (_video(1, 16, 16)[..., 0] > 0.5).float()
    _assert_same(node.build("inpaint", 832, 480, 81, video=video, mask=mask), vb.inpaint_from_mask(video, mask))
    _assert_same(node.build("box", 32, 16, 5, box_x=1, box_y=2, box_w=5, box_h=3, end_box_x=20, end_box_y=8,
                            end_box_w=6, end_box_h=4),
                 vb.box_mask(32, 16, 5, (1, 2, 5, 3), (20, 8, 6, 4)))
    _assert_same(node.build("box", 32, 16, 5, box_w=5, box_h=3), vb.box_mask(32, 16, 5, (0, 0, 5, 3)))
    _assert_same(node.build("outpaint", 832, 480, 81, video=video, pad_left=8, pad_right=8),
                 vb.outpaint(video, 8, 0, 8, 0))
    _assert_same(node.build("extend", 832, 480, 9, video=video, keep_first=3, keep_last=1),
                 vb.extend(video, 9, 3, 1))
    _assert_same(node.build("first_last", 832, 480, 9, video=video, last_image=video),
                 vb.first_last_frame(video[:1], video[-1:], 9))


@pytest.mark.parametrize("mode, missing", [("inpaint", "mask"), ("outpaint", "video"), ("extend", "video"),
                                           ("first_last", "video")])
def test_mask_node_names_a_missing_input_and_the_mode(mode, missing):
    inputs = {"video": _video(5, 16, 16)} if missing != "video" else {}
    with pytest.raises(ValueError, match=f"'{mode}'.*'{missing}'"):
        vace_nodes.WanMeshVaceMask().build(mode, 16, 16, 5, **inputs)


def test_reference_and_control_nodes_match_the_builders():
    images = torch.rand(2, 8, 16, 4, generator=torch.Generator().manual_seed(3))
    alpha = torch.rand(2, 8, 16, generator=torch.Generator().manual_seed(4))
    _assert_same(vace_nodes.WanMeshVaceReference().build(images, 32, 32, alpha),
                 (vb.reference_images(images, 32, 32, alpha),))
    video = _video(2, 32, 32)
    for mode in vb.CONTROL_MODES:
        _assert_same(vace_nodes.WanMeshVaceControl().build(video, mode, 50, 150, 16, 32),
                     (vb.control_from_video(video, mode, 16, 32, 50, 150),))
    _assert_same(vace_nodes.WanMeshVaceControl().build(video, "gray", 100, 200),
                 (vb.control_from_video(video, "gray"),))
