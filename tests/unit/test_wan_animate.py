"""Wan 2.2 Animate's file recognition and its face adapter under a sequence split (``networks/wan_animate.py``),
without the 512x512 motion encoder: the end-to-end parity with native runs in ``tests/comfyui/test_animate.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from wanmesh.parallel.distributed.context_parallel import SequenceShard
from wanmesh.parallel.networks.wan_animate import (ANIMATE_PREFIXES, FaceBlock, WanAnimateTransformer,
                                                   animate_released_name, frame_runs, released_animate_name)
from wanmesh.parallel.tiny.models import NATIVE_ANIMATE, original_transformer_names
from wanmesh.parallel.weights.detect import ANIMATE_CLASS, detect_kind, image_inputs, infer_transformer_config
from wanmesh.parallel.weights.checkpoint import build_empty, rename_map
from wanmesh.parallel.weights.loaders import TRANSFORMER_CLASSES, convert_wan_transformer_keys

TOKENS_PER_FRAME = 6


@pytest.fixture(scope="module")
def animate_shapes() -> dict[str, tuple[int, ...]]:
    """The released names and shapes of the tiny Animate model (built empty: nothing is computed), as its header
    says them."""
    model = build_empty(lambda: WanAnimateTransformer.from_config(NATIVE_ANIMATE))
    state = model.state_dict()
    base = rename_map(original_transformer_names(NATIVE_ANIMATE), convert_wan_transformer_keys)
    shapes = {original: tuple(state[name].shape) for name, original in base.items()}
    shapes.update({animate_released_name(name): tuple(tensor.shape) for name, tensor in state.items()
                   if name.startswith(ANIMATE_PREFIXES)})
    return shapes


def test_an_animate_file_is_recognised_and_loads_into_the_animate_class(animate_shapes) -> None:
    assert detect_kind(animate_shapes) == "wan_animate"
    assert detect_kind({f"model.diffusion_model.{key}": shape for key, shape in animate_shapes.items()}) == "wan_animate"
    assert "face_encoder.conv1_local.conv.weight" in animate_shapes  # the released names
    config = infer_transformer_config(animate_shapes, {"num_heads": "2"})
    assert config["_class_name"] == ANIMATE_CLASS and config["in_channels"] == 36 and config["num_layers"] == 5
    assert image_inputs(config) == "animate"
    assert TRANSFORMER_CLASSES[config["_class_name"]] is WanAnimateTransformer
    # every released name maps onto exactly the model's parameters (the per-tensor reader's name map)
    names = rename_map(list(animate_shapes), convert_wan_transformer_keys)
    model = build_empty(lambda: WanAnimateTransformer.from_config(config))
    assert set(names) == set(model.state_dict())


def test_the_released_names_round_trip() -> None:
    for name in ("face_encoder.conv2.weight", "face_adapter.fuser_blocks.0.q_norm.weight",
                 "motion_encoder.enc.net_app.convs.1.conv2.1.weight"):
        assert released_animate_name(animate_released_name(name)) == name


def test_frame_runs_leave_out_padding() -> None:
    frames = torch.tensor([0, 0, 1, 1, 1, 2, -1, -1])
    assert frame_runs(frames) == [(0, 0, 2), (1, 2, 5), (2, 5, 6)]


@pytest.mark.parametrize("count", [2, 4])
def test_the_face_block_is_exact_under_a_sequence_split_that_cuts_frames(count: int) -> None:
    """Each rank's slice (starting mid-frame, the last one padded) gives the rows of the unsplit result."""
    torch.manual_seed(0)
    dim, heads, frames = 64, 2, 3
    block = FaceBlock(dim, heads)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    tokens = frames * TOKENS_PER_FRAME - 1  # not a multiple of the split: the last slice is padded
    x, face = torch.randn(2, tokens, dim), torch.randn(2, frames, 5, dim)
    whole = block(x, face, torch.arange(tokens) // TOKENS_PER_FRAME)
    pieces = []
    for index in range(count):
        shard = SequenceShard(valid_len=tokens, index=index, count=count)
        positions = torch.arange(index * shard.local_len, (index + 1) * shard.local_len)
        token_frames = torch.where(positions < tokens, positions // TOKENS_PER_FRAME, -1)
        pieces.append(block(shard.local_slice(x), face, token_frames))
    split = torch.cat(pieces, dim=1)[:, :tokens]
    assert (split - whole).abs().max().item() <= 1e-6
    # and each frame's tokens see their own frame's face: another face for frame 1 changes only frame 1's rows
    other = face.clone()
    other[:, 1] = torch.randn_like(other[:, 1])
    changed = (block(x, other, torch.arange(tokens) // TOKENS_PER_FRAME) - whole).abs().amax(dim=(0, 2)) > 1e-6
    assert changed.tolist() == [TOKENS_PER_FRAME <= i < 2 * TOKENS_PER_FRAME for i in range(tokens)]


def test_the_model_takes_the_sequence_slice_of_its_context_parallel_shard() -> None:
    model = SimpleNamespace(context_parallel=SimpleNamespace(
        current_shard=lambda: SequenceShard(valid_len=10, index=1, count=2)))
    call = SimpleNamespace(tokens_per_frame=4)
    frames = WanAnimateTransformer._token_frames(model, 5, call)
    assert frames.tolist() == [1, 1, 1, 2, 2]
    model.context_parallel = None
    assert WanAnimateTransformer._token_frames(model, 5, call).tolist() == [0, 0, 0, 0, 1]


def test_scaled_fp8_and_gguf_animate_files_load_and_run(tmp_path) -> None:
    """The tiny Animate file as ComfyUI scaled fp8 and as a Q8_0 GGUF: recognised from the header, loaded by the
    rank loader (block linears kept quantized, the Animate modules as stored) and within the quantization's error
    of the float file (with pose latents; the face path is the float file's: tests/comfyui/test_animate.py)."""
    from gguf import GGMLQuantizationType

    from wanmesh.parallel.tensor_files import save_tensors_atomic
    from wanmesh.parallel.tiny.fp8_write import write_fp8_file
    from wanmesh.parallel.tiny.gguf_write import write_wan_gguf
    from wanmesh.parallel.tiny.models import SEED, animate_state
    from wanmesh.parallel.weights.detect import safetensors_kind
    from wanmesh.parallel.weights.loaders import load_transformer

    state = animate_state(NATIVE_ANIMATE, SEED + 35)
    paths = {"float": tmp_path / "animate.safetensors", "fp8_scaled": tmp_path / "animate_fp8_scaled.safetensors",
             "Q8_0": tmp_path / "animate_Q8_0.gguf"}
    save_tensors_atomic(state, paths["float"], metadata={"num_heads": "2"})
    write_fp8_file(state, paths["fp8_scaled"], torch.float8_e4m3fn, scaled=True, metadata={"num_heads": "2"})
    write_wan_gguf(state, paths["Q8_0"], GGMLQuantizationType.Q8_0, num_heads=2)
    del state
    torch.manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 36, 2, 4, 6), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 512, 4096), pose_latents=torch.randn(1, 16, 1, 4, 6))
    outputs = {}
    for kind, path in paths.items():
        assert safetensors_kind(str(path)) == "wan_animate", kind
        model = load_transformer(str(path))
        assert isinstance(model, WanAnimateTransformer)
        with torch.no_grad():
            outputs[kind] = model(**inputs, return_dict=False)[0]
    for kind in ("fp8_scaled", "Q8_0"):
        error = ((outputs[kind] - outputs["float"]).norm() / outputs["float"].norm()).item()
        assert 0 < error < 0.05, f"{kind}: relative error {error:.3g}"


@pytest.mark.parametrize("field, shape, named", [
    ("face_pixels", (2, 3, 5, 256, 256), "the face video has shape [2, 3, 5, 256, 256]; expected [2, 3, frames, 512, 512]"),
    ("pose_latents", (2, 16, 2, 8, 8), "the pose video latents have shape [2, 16, 2, 8, 8]; expected [2, 16, frames, 4, 6]"),
])
def test_a_model_call_with_animate_inputs_of_the_wrong_shape_is_one_line(field, shape, named) -> None:
    from wanmesh.parallel.protocol import ModelForward

    request = ModelForward(handle="m", latent=torch.zeros(2, 36, 3, 4, 6), timestep=torch.zeros(2),
                           context=torch.zeros(2, 512, 4096), **{field: torch.zeros(shape)})
    with pytest.raises(ValueError) as refused:
        request.validate()
    message = str(refused.value)
    assert message.startswith(named) and "\n" not in message and len(message) <= 300, message
    fine = ModelForward(handle="m", latent=torch.zeros(2, 36, 3, 4, 6), timestep=torch.zeros(2),
                        context=torch.zeros(2, 512, 4096), pose_latents=torch.zeros(1, 16, 2, 4, 6),
                        face_pixels=torch.zeros(2, 3, 1, 512, 512))
    fine.validate()


@pytest.mark.parametrize("field", ["face_pixels", "face_pixels_negative", "pose_latents", "pose_latents_negative"])
def test_a_sample_request_with_a_pass_s_animate_input_of_the_wrong_shape_is_one_line(field: str) -> None:
    from wanmesh.parallel.protocol import SampleRequest

    wrong = torch.zeros(1, 3, 1, 256, 256) if field.startswith("face") else torch.zeros(1, 16, 2, 8, 8)
    request = SampleRequest(handle="m", latent=torch.zeros(1, 16, 3, 4, 6), positive=[torch.zeros(4, 8)],
                            negative=[torch.zeros(4, 8)], seed=1, steps=2, guidance_scale=3.0, shift=8.0,
                            sampler="euler", scheduler="simple", **{field: wrong})
    with pytest.raises(ValueError) as refused:
        request.validate()
    message = str(refused.value)
    assert str(list(wrong.shape)) in message and "WanAnimateToVideo" in message, message
    assert "\n" not in message and len(message) <= 300, message


class RecordingAnimateModel:
    """Stands in for the Animate transformer (a face adapter, no image channels): records each call's Animate
    inputs and returns its latents as the prediction."""

    face_adapter = object()
    config = SimpleNamespace(in_channels=16, out_channels=16)

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, hidden_states, timestep, encoder_hidden_states, return_dict, **kwargs):
        self.calls.append(kwargs)
        return (hidden_states,)


def test_the_wanmesh_sampler_gives_each_guidance_pass_its_own_animate_inputs() -> None:
    """WanAnimateToVideo's outputs as the WanMesh Sampler reads them: the negative's face video (all -1) reaches
    the unconditional pass, the positive's the conditional one, each with the pose latents normalised as native's
    WAN22_Animate takes them."""
    from wanmesh.nodes.bridge.convert import animate_passes, read_conditioning
    from wanmesh.parallel.protocol import SampleRequest
    from wanmesh.parallel.sampling.guidance import guided_prediction
    from wanmesh.parallel.sampling.latents import normalize_latents
    from wanmesh.parallel.sampling.loop import conditioning_inputs

    pose, face = torch.randn(1, 16, 2, 4, 6), torch.rand(1, 3, 1, 512, 512) * 2 - 1
    positive = read_conditioning([[torch.zeros(1, 4, 8), {"pose_video_latent": pose, "face_video_pixels": face}]])
    negative = read_conditioning([[torch.zeros(1, 4, 8), {"pose_video_latent": pose,
                                                          "face_video_pixels": face * 0.0 - 1.0}]], "negative")
    request = SampleRequest(handle="m", latent=torch.zeros(1, 16, 3, 4, 6), positive=positive.embeddings,
                            negative=negative.embeddings, seed=1, steps=2, guidance_scale=3.0, shift=8.0,
                            sampler="euler", scheduler="simple", **animate_passes(positive, negative))
    request.validate()
    model = RecordingAnimateModel()
    extra = conditioning_inputs(model, request, range(1), torch.float32, "cpu")
    guided_prediction(model, torch.zeros(1, 16, 3, 4, 6), torch.tensor(500.0), torch.zeros(1, 4, 8),
                      torch.ones(1, 4, 8), 3.0, extra)
    conditional, unconditional = model.calls
    assert torch.equal(conditional["face_pixel_values"], face)
    assert unconditional["face_pixel_values"].eq(-1).all()
    for call in (conditional, unconditional):
        assert torch.equal(call["pose_latents"], normalize_latents(pose))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_the_frame_slices_cover_every_face_frame_once_in_order(ranks: int) -> None:
    from wanmesh.parallel.distributed.context_parallel import SequenceShard

    for count in range(0, 10):
        slices = [SequenceShard(valid_len=count, index=index, count=ranks) for index in range(ranks)]
        frames = [frame for piece in slices for frame in range(*piece.bounds())]
        assert frames == list(range(count))
        assert all(stop - start <= piece.local_len for piece in slices for start, stop in [piece.bounds()])


def test_the_frame_split_plan_names_animate_s_motion_encoder_only() -> None:
    from wanmesh.parallel.distributed.frame_split import frame_split_plan

    assert frame_split_plan(build_empty(lambda: WanAnimateTransformer.from_config(NATIVE_ANIMATE))) == ("motion_encoder",)
    assert frame_split_plan(torch.nn.Linear(2, 2)) == ()
