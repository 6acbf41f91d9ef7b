"""GGUF bad input: an unsupported tensor type, another architecture and a latent width other than Wan's 16 and Wan 2.2
TI2V 5B's 48 each fail with one clear line before any weight is dequantised (a tensor-parallel cut off the quant blocks is no longer an
error: that tensor is dequantized at load, see test_quantized.py); the model loader lists .gguf files; sampling
from the Q8_0 file stays close to the float model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_kinds import write_gguf_tensors
from wanmesh.parallel.weights import gguf_file
from wanmesh.parallel.weights.detect import safetensors_kind
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER
from wanmesh.parallel.weights.loaders import load_transformer
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import sample

Q = gguf.GGMLQuantizationType


def _wan_like(channels: int = 16) -> dict[str, tuple[np.ndarray, Q]]:
    rng = np.random.default_rng(0)
    return {"patch_embedding.weight": (rng.standard_normal((64, channels, 1, 2, 2), dtype=np.float32), Q.F32),
            "head.head.weight": (rng.standard_normal((channels * 4, 64), dtype=np.float32), Q.F16),
            "blocks.0.self_attn.q.weight": (rng.standard_normal((64, 64), dtype=np.float32), Q.Q8_0)}


@pytest.fixture
def no_dequantisation(monkeypatch):
    """Fail the test if any tensor is dequantised: the checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was dequantised before the check")

    monkeypatch.setattr(gguf_file.GGUFFile, "read_dequantised", refuse)


def test_unsupported_type_is_refused(tmp_path, no_dequantisation):
    tensors = _wan_like()
    tensors["blocks.0.ffn.0.weight"] = (np.zeros((64, 256), dtype=np.float32), Q.TQ2_0)
    path = write_gguf_tensors(tmp_path / "ternary.gguf", tensors)
    with pytest.raises(ValueError, match=r"blocks.0.ffn.0.weight has GGUF type TQ2_0.*supported types: .*Q4_K") as error:
        load_transformer(path)
    assert "\n" not in str(error.value)


def test_other_architecture_is_refused(tmp_path, no_dequantisation):
    tensors = {"token_embd.weight": (np.ones((8, 32), dtype=np.float32), Q.Q8_0)}
    path = write_gguf_tensors(tmp_path / "llama.gguf", tensors, "llama")
    with pytest.raises(ValueError, match=r"architecture 'llama', not a Wan transformer"):
        load_transformer(path)
    assert safetensors_kind(path) == "unknown"


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "renamed.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"renamed.gguf: cannot read as GGUF") as error:
        load_transformer(str(path))
    assert "\n" not in str(error.value)


def test_other_latent_widths_are_refused_and_ti2v_5b_passes_the_check(tmp_path, no_dequantisation):
    path = write_gguf_tensors(tmp_path / "wide.gguf", _wan_like(channels=32))
    with pytest.raises(ValueError, match=r"predicts 32-channel latents; supported: .*Wan 2.2 TI2V 5B \(48"):
        load_transformer(path)
    gguf_file.GGUFFile(write_gguf_tensors(tmp_path / "ti2v.gguf", _wan_like(channels=48))).close()


def test_gguf_files_are_detected_and_listed(tiny_models, monkeypatch):
    import sys
    import types

    folder = str(tiny_models["t2v"].parent)
    stub = types.ModuleType("folder_paths")
    stub.folder_names_and_paths = {"diffusion_models": ([folder], {".safetensors"})}
    stub.get_filename_list = lambda name: sorted(
        p.name for p in tiny_models["t2v"].parent.iterdir()
        if p.suffix in stub.folder_names_and_paths[name][1] and str(p.parent) in stub.folder_names_and_paths[name][0])
    monkeypatch.setitem(sys.modules, "folder_paths", stub)
    monkeypatch.setitem(stub.folder_names_and_paths, "diffusers", ([], set()))
    from wanmesh.nodes.bridge.files import list_models

    listed = list_models("diffusion_models")
    assert {"wan_tiny_t2v_Q8_0.gguf", "wan_tiny_t2v_Q4_K.gguf", "wan_tiny_t2v.safetensors"} <= set(listed)
    assert safetensors_kind(str(tiny_models["t2v_gguf_q8_0"])) == "wan_t2v"


def test_q8_0_sampling_is_close_to_the_float_model(tiny_models):
    generator = torch.Generator().manual_seed(7)
    text_dim = TINY_TRANSFORMER["text_dim"]
    request = SampleRequest(
        handle="", latent=torch.zeros(1, 16, 2, 8, 8), positive=[torch.randn(9, text_dim, generator=generator)],
        negative=[torch.randn(4, text_dim, generator=generator)], seed=3, steps=4, guidance_scale=5.0, shift=3.0)
    with torch.no_grad():
        floats = sample(load_transformer(str(tiny_models["t2v"])), request)
        quantised = sample(load_transformer(str(tiny_models["t2v_gguf_q8_0"])), request)
    error = (quantised - floats).abs()
    print(f"Q8_0 vs float sampling: max |error| {error.max():.4g}, mean |error| {error.mean():.4g}, "
          f"latent std {floats.std():.4g}")
    assert floats.std() > 0.1
    assert error.max() > 0, "the Q8_0 weights must differ from the float ones"
    # Q8_0 keeps each weight within ~0.4% of its block's largest; 4 steps at guidance 5 amplify that to ~1-2%.
    assert error.max() < 0.03 * floats.abs().max() and error.mean() < 0.03 * floats.abs().mean()
