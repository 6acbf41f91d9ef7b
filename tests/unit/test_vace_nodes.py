"""The VACE nodes' ComfyUI side: conditioning laid out exactly as WanVaceToVideo makes it (lists appended per
chained encode), read back by the sampler node, the empty latent and trim, and refusals made before any
pool work. The pool is replaced by a recording stand-in; nothing here imports ComfyUI."""

from __future__ import annotations

import pytest
import torch

from wanmesh.nodes.bridge.convert import check_same_vace, read_conditioning
from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.nodes.vace import WanMeshTrimLatent, WanMeshVaceEncode
from wanmesh.parallel import protocol as P


class RecordingRunner:
    """Answers encode_vace with fixed native tensors and records the requests."""

    def __init__(self, references: int):
        self.requests: list[P.EncodeVace] = []
        self.references = references

    def encode_vace(self, request: P.EncodeVace) -> P.VaceEncoded:
        self.requests.append(request)
        frames = (request.length - 1) // 4 + 1 + self.references
        h, w = request.height // 8, request.width // 8
        seed = len(self.requests)
        generator = torch.Generator().manual_seed(seed)
        return P.VaceEncoded(torch.randn(1, 32, frames, h, w, generator=generator),
                             torch.rand(1, 64, frames, h, w, generator=generator), self.references)


def _text(tokens: int = 7):
    return [[torch.randn(1, tokens, 64), {"pooled_output": None}]]


def test_two_chained_encodes_append_two_contexts_like_wan_vace_to_video():
    runner = RecordingRunner(references=1)
    vae = ResidentModel(runner, "vae|tiny")
    node = WanMeshVaceEncode()
    positive, negative = _text(), _text(3)
    pos1, neg1, latent, trim = node.encode(positive, negative, vae, 64, 48, 9, 2, 0.8,
                                           reference_image=torch.rand(1, 48, 64, 3))
    pos2, neg2, _, _ = node.encode(pos1, neg1, vae, 64, 48, 9, 2, 0.5, control_video=torch.rand(9, 48, 64, 3))
    assert trim == 1 and list(latent["samples"].shape) == [2, 16, 1 + 3, 6, 8]
    assert torch.count_nonzero(latent["samples"]) == 0
    for conditioning in (pos2, neg2):
        (tensor, options), = conditioning
        assert len(options["vace_frames"]) == len(options["vace_mask"]) == 2
        assert options["vace_strength"] == [0.8, 0.5]
        assert [list(t.shape) for t in options["vace_frames"]] == [[1, 32, 4, 6, 8]] * 2
        assert [list(t.shape) for t in options["vace_mask"]] == [[1, 64, 4, 6, 8]] * 2
        assert options["pooled_output"] is None  # other keys are kept
    assert "vace_frames" not in positive[0][1], "the input conditioning must not be changed in place"
    assert len(pos1[0][1]["vace_frames"]) == 1
    assert pos2[0][0] is positive[0][0]
    read = read_conditioning(pos2)
    assert len(read.vace_frames) == 2 and read.vace_strengths == [0.8, 0.5]
    check_same_vace(read, read_conditioning(neg2))
    assert runner.requests[0].reference_images.shape == (1, 48, 64, 3) and runner.requests[1].control_video is not None


def test_mismatched_vace_between_positive_and_negative_is_refused():
    runner = RecordingRunner(references=0)
    node = WanMeshVaceEncode()
    positive, negative, _, _ = node.encode(_text(), _text(), ResidentModel(runner, "vae|tiny"), 64, 48, 5, 1, 1.0)
    with pytest.raises(ValueError, match="positive carries 1 VACE contexts and negative 0"):
        check_same_vace(read_conditioning(positive), read_conditioning(_text()))


def test_conditioning_combine_is_refused_instead_of_cut():
    combined = _text() + _text()
    with pytest.raises(ValueError, match="holds 2 entries"):
        read_conditioning(combined, "positive")


def test_trim_latent_drops_the_reference_frames_and_refuses_dropping_all():
    samples = torch.arange(2 * 16 * 5 * 2 * 2, dtype=torch.float32).reshape(2, 16, 5, 2, 2)
    (trimmed,) = WanMeshTrimLatent().trim({"samples": samples}, 2)
    assert torch.equal(trimmed["samples"], samples[:, :, 2:])
    with pytest.raises(ValueError, match="would drop all 5 latent frames"):
        WanMeshTrimLatent().trim({"samples": samples}, 5)
