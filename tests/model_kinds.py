"""Every model-file kind a user can give WanMesh, written from the tiny T2V transformer into a models tree; runs in
the test process (once per session, by the ``model_kinds`` fixtures).

Kinds: safetensors in fp32, fp16, bf16, plain fp8 (e4m3fn, e5m2) and ComfyUI's scaled fp8, the same weights under
ComfyUI's ``model.diffusion_model.`` prefix, the diffusers folder ``wanmesh make-tiny`` writes, and GGUF files of
every supported tensor type plus one mixed file as llama.cpp's Q4_K_M makes it. Each kind carries the error bar its
sampled latents must keep against the float file's (``relative_error``), chosen from measured errors with margin.
Writers: ``tiny/fp8_write.py`` (fp8, scaled fp8) and ``tiny/gguf_write.py`` (every GGUF type; a per-tensor type
rule for the mixed file).

The files go under ``diffusion_models/kinds/`` (the diffusers kind is the tree's own ``diffusers/wan_tiny_t2v``),
so a ComfyUI server configured with the tree lists them as ``kinds/<file>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from checks import relative_error  # noqa: F401  (re-exported for the kind tests)
from wanmesh.parallel.weights.checkpoint import COMFY_TRANSFORMER_PREFIX, SCALED_FP8_MARKER
from wanmesh.parallel.weights.detect import UNSUPPORTED_FAMILIES
from wanmesh.parallel.weights.gguf_file import block_size
from wanmesh.parallel.tiny.fp8_write import fp8_state, write_fp8_file
from wanmesh.parallel.tiny.gguf_write import gguf_storage_type, quantize, write_wan_gguf
from wanmesh.parallel.tiny.models import TINY_TRANSFORMER

Q = gguf.GGMLQuantizationType
KINDS_FOLDER = "diffusion_models/kinds"
DIFFUSERS_T2V = "diffusers/wan_tiny_t2v"  # written by make-tiny: the T2V pipeline folder
HEADS = TINY_TRANSFORMER["num_attention_heads"]
METADATA = {"num_heads": str(HEADS)}

# Relative error bars (||latents - float latents|| / ||float latents||, ``relative_error``) for 2 unipc steps at cfg 5
# on the tiny model, 32x32, 5 frames. Measured (command line and Model Loader alike, keep = dequantize): 0 for the same
# float32 weights; fp16 3e-4, bf16 2.7e-3 (GGUF F16 2.5e-4, BF16 2.2e-3); fp8 e4m3fn 0.018, scaled 0.018, e5m2 0.037;
# Q8_0 0.007; Q6_K 0.010, Q5_K 0.024, Q5_1 0.050, Q5_0 0.058; Q4_K 0.039, Q4_K_M 0.051, Q3_K 0.073, Q4_1 0.107,
# Q4_0 0.111; Q2_K 0.179. Another seed: 1.3. The K types cover few tensors here: only ffn.2 and time_embedding.0 have
# whole 256-blocks in this model (the rest falls back to F16, or Q5_0 / Q8_0 in the mixed file). Each bar is about
# twice the largest error measured for its kinds.
EXACT = 1e-6  # the same float32 weights (re-saved, prefixed, diffusers folder, GGUF F32)
HALF = 0.01  # fp16 / bf16 weights
FP8 = 0.08  # plain (e4m3fn, e5m2) and scaled fp8
Q8 = 0.02  # Q8_0
Q5_Q6 = 0.12  # Q6_K, Q5_K, Q5_0, Q5_1
Q4 = 0.25  # Q4_K, Q4_0, Q4_1, the mixed Q4_K_M, Q3_K
Q2 = 0.4  # Q2_K


@dataclass(frozen=True)
class ModelKind:
    """One kind of transformer file: where it lives in the tree, how it is written, its error bar."""

    name: str
    file: str  # relative to the models tree
    bar: float
    quantized: bool  # stored quantized (fp8, GGUF quant blocks): "keep" and "dequantize" hold it differently
    write: Callable[[Mapping[str, torch.Tensor], Path], None] | None  # None: written by make-tiny already


def _safetensors(dtype: torch.dtype, prefix: str = ""):
    def write(state, path):
        save_file({prefix + key: tensor.to(dtype).contiguous() for key, tensor in state.items()}, path,
                  metadata=METADATA)
    return write


def _fp8(fp8_dtype: torch.dtype, scaled: bool):
    return lambda state, path: write_fp8_file(state, path, fp8_dtype, scaled, metadata=METADATA)


def _gguf(tensor_type: Q, type_of=None):
    return lambda state, path: write_wan_gguf(state, path, tensor_type, num_heads=HEADS, type_of=type_of)


# -- a mixed GGUF: llama.cpp's Q4_K_M choice per tensor --------------------------------------------------------

_K_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's type for a K-quant whose 256-blocks do not fit a row
_MORE_BITS_PARTS = (".self_attn.v.", ".ffn.2.")  # Q4_K_M gives attn_v and ffn_down Q6_K in some layers


def _uses_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(key: str, shape: tuple[int, ...], layers: int) -> Q:
    """The type llama.cpp's Q4_K_M stores tensor ``key`` as: Q6_K for the value projection and FFN output of the
    layers that get more bits, Q4_K otherwise, each falling back when the row is not whole 256-blocks; small,
    1-D, modulation and 5-D tensors stay F32 (``gguf_storage_type``'s rule)."""
    if gguf_storage_type(key, shape, Q.Q8_0) == Q.F32:
        return Q.F32
    match = re.match(r"blocks\.(\d+)\.", key)
    more_bits = match is not None and any(part in key for part in _MORE_BITS_PARTS) and \
        _uses_more_bits(int(match.group(1)), layers)
    target = Q.Q6_K if more_bits or key == "head.head.weight" else Q.Q4_K
    return target if shape[-1] % block_size(target) == 0 else _K_FALLBACK[target]


def _q4_k_m(key: str, shape: tuple[int, ...]) -> Q:
    return q4_k_m_type(key, shape, TINY_TRANSFORMER["num_layers"])


# -- the kinds -----------------------------------------------------------------------------------------------

def _file(stem: str, suffix: str) -> str:
    return f"{KINDS_FOLDER}/wan_tiny_t2v_{stem}{suffix}"


_GGUF_BARS = {Q.F32: EXACT, Q.F16: HALF, Q.BF16: HALF, Q.Q8_0: Q8, Q.Q6_K: Q5_Q6, Q.Q5_K: Q5_Q6, Q.Q5_0: Q5_Q6,
              Q.Q5_1: Q5_Q6, Q.Q4_K: Q4, Q.Q4_0: Q4, Q.Q4_1: Q4, Q.Q3_K: Q4, Q.Q2_K: Q2}
KINDS: dict[str, ModelKind] = {kind.name: kind for kind in [
    ModelKind("fp32", _file("fp32", ".safetensors"), EXACT, False, _safetensors(torch.float32)),
    ModelKind("fp16", _file("fp16", ".safetensors"), HALF, False, _safetensors(torch.float16)),
    ModelKind("bf16", _file("bf16", ".safetensors"), HALF, False, _safetensors(torch.bfloat16)),
    ModelKind("fp8_e4m3fn", _file("fp8_e4m3fn", ".safetensors"), FP8, True, _fp8(torch.float8_e4m3fn, False)),
    ModelKind("fp8_e5m2", _file("fp8_e5m2", ".safetensors"), FP8, True, _fp8(torch.float8_e5m2, False)),
    ModelKind("fp8_scaled", _file("fp8_scaled", ".safetensors"), FP8, True, _fp8(torch.float8_e4m3fn, True)),
    ModelKind("prefixed", _file("prefixed", ".safetensors"), EXACT, False,
              _safetensors(torch.float32, COMFY_TRANSFORMER_PREFIX)),
    ModelKind("diffusers", DIFFUSERS_T2V, EXACT, False, None),
    *(ModelKind(f"gguf_{t.name}", _file(t.name, ".gguf"), bar, t not in (Q.F32, Q.F16, Q.BF16), _gguf(t))
      for t, bar in _GGUF_BARS.items()),
    ModelKind("gguf_Q4_K_M", _file("Q4_K_M", ".gguf"), Q4, True, _gguf(Q.Q4_K, _q4_k_m)),
]}
FLOAT_KIND = "fp32"  # the reference every kind is compared with


@dataclass(frozen=True)
class WrittenKinds:
    """The kinds written into one models tree."""

    root: Path

    def path(self, name: str) -> Path:
        return self.root / KINDS[name].file

    def comfy_name(self, name: str) -> str:
        """The name ComfyUI's Model Loader lists the kind under."""
        file = KINDS[name].file
        return file if file.startswith("diffusers/") else file.removeprefix("diffusion_models/")


def write_model_kinds(root: Path, float_file: Path) -> WrittenKinds:
    """Write every kind of ``float_file`` (an original-layout T2V safetensors) under ``root``."""
    state = load_file(str(float_file))
    (root / KINDS_FOLDER).mkdir(parents=True, exist_ok=True)
    for kind in KINDS.values():
        if kind.write is not None:
            kind.write(state, root / kind.file)
    return WrittenKinds(root)


# -- files that must be refused before any weight is read, and one that looks odd but is fine -------------------

BAD_FOLDER = f"{KINDS_FOLDER}/bad"
# Wan families refused at load: the tiny T2V plus each family's telltale tensor, in a file kind per family (ComfyUI's
# prefix, GGUF and scaled fp8 among them: the family is told from any kind's header).
UNSUPPORTED_SUFFIXES = {"wan_s2v": ".gguf", "wan_humo": "_prefixed.safetensors", "wan_infinitetalk": ".safetensors",
                        "wan_dancer": "_fp8_scaled.safetensors", "wan_scail": ".safetensors",
                        "wan_animate": ".safetensors", "wan_camera": ".safetensors"}  # kinds no longer refused unused
TELLTALE_KEYS = {"wan_s2v": "casual_audio_encoder.encoder.final_linear.weight",
                 "wan_humo": "audio_proj.audio_proj_glob_1.layer.bias",
                 "wan_infinitetalk": "blocks.0.audio_cross_attn.q_linear.weight",
                 "wan_dancer": "patch_embedding_global.weight",
                 "wan_scail": "patch_embedding_pose.weight",
                 "wan_animate": "face_adapter.fuser_blocks.0.k_norm.weight"}
# name -> (file under BAD_FOLDER, what the one-line error must say)
BAD_MODEL_FILES = {
    "gguf_llama": ("llama_Q8_0.gguf", "a GGUF of architecture 'llama', not a Wan transformer"),
    "gguf_flux": ("flux_Q8_0.gguf", "a GGUF of architecture 'flux', not a Wan transformer"),
    "gguf_truncated": ("wan_tiny_t2v_Q8_0_truncated.gguf", "cannot read as GGUF"),
    "gguf_unsupported_type": ("wan_tiny_t2v_TQ2_0.gguf", "has GGUF type TQ2_0, which cannot be loaded"),
    "fp8_scaled_missing_scale": ("wan_tiny_t2v_fp8_scaled_missing_scale.safetensors",
                                 "has ComfyUI's scaled_fp8 marker but its fp8 weight blocks.0.self_attn.q.weight has "
                                 "no blocks.0.self_attn.q.scale_weight"),
    **{kind: (f"wan_tiny_{kind.removeprefix('wan_')}{suffix}",
              f"is a {family} model (keys {telltale.strip('.')}.*), a Wan variant WanMesh does not support yet")
       for kind, (family, telltale) in UNSUPPORTED_FAMILIES.items() for suffix in [UNSUPPORTED_SUFFIXES[kind]]},
}
SCALES_WITHOUT_MARKER = f"{KINDS_FOLDER}/wan_tiny_t2v_fp8_scales_without_marker.safetensors"  # loads as scaled fp8
UNSUPPORTED_TYPE_TENSOR = "blocks.0.ffn.2.weight"  # input 256: whole TQ2_0 blocks


def write_gguf_tensors(path: str | Path, tensors: Mapping[str, tuple[np.ndarray, Q]], arch: str = "wan") -> str:
    """A GGUF of ``arch`` holding ``tensors`` ({key: (float32 array, type)}), nothing else: files no converter
    writes (another architecture, an unsupported type)."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    for key, (array, tensor_type) in tensors.items():
        writer.add_tensor(key, quantize(array, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _foreign_gguf(arch: str, key: str):
    return lambda state, path: write_gguf_tensors(path, {key: (np.ones((8, 32), dtype=np.float32), Q.Q8_0)}, arch)


def _truncated_gguf(state, path):
    _gguf(Q.Q8_0)(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _unsupported_type(key: str, shape: tuple[int, ...]) -> Q:
    return Q.TQ2_0 if key == UNSUPPORTED_TYPE_TENSOR else gguf_storage_type(key, shape, Q.Q8_0)


def _scaled_fp8_without(drop: Callable[[str], bool]):
    """A scaled fp8 file with the tensors ``drop`` names left out."""
    def write(state, path):
        stored = fp8_state(state, torch.float8_e4m3fn, scaled=True)
        save_file({key: tensor for key, tensor in stored.items() if not drop(key)}, str(path), metadata=METADATA)
    return write


def _with_telltale(kind: str, suffix: str):
    """The T2V state plus ``kind``'s telltale tensor, written as ``suffix`` says."""
    write = {".gguf": _gguf(Q.Q8_0), "_prefixed.safetensors": _safetensors(torch.float32, COMFY_TRANSFORMER_PREFIX),
             ".safetensors": _safetensors(torch.float32),
             "_fp8_scaled.safetensors": _fp8(torch.float8_e4m3fn, scaled=True)}[suffix]
    return lambda state, path: write({**state, TELLTALE_KEYS[kind]: torch.ones(state["head.head.weight"].shape[1],
                                                                               32)}, path)


_BAD_WRITERS = {
    **{kind: _with_telltale(kind, UNSUPPORTED_SUFFIXES[kind]) for kind in UNSUPPORTED_FAMILIES},
    "gguf_llama": _foreign_gguf("llama", "token_embd.weight"),
    "gguf_flux": _foreign_gguf("flux", "double_blocks.0.img_attn.qkv.weight"),
    "gguf_truncated": _truncated_gguf,
    "gguf_unsupported_type": _gguf(Q.Q8_0, _unsupported_type),
    "fp8_scaled_missing_scale": _scaled_fp8_without(lambda key: key == "blocks.0.self_attn.q.scale_weight"),
}


def write_bad_model_files(root: Path, float_file: Path) -> dict[str, Path]:
    """The ``BAD_MODEL_FILES`` under ``root``, plus ``SCALES_WITHOUT_MARKER``; {name: path}."""
    state = load_file(str(float_file))
    (root / BAD_FOLDER).mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (file, _) in BAD_MODEL_FILES.items():
        written[name] = root / BAD_FOLDER / file
        _BAD_WRITERS[name](state, written[name])
    written["scales_without_marker"] = root / SCALES_WITHOUT_MARKER
    _scaled_fp8_without(lambda key: key == SCALED_FP8_MARKER)(state, written["scales_without_marker"])
    return written


# -- VACE modules in quantized kinds -------------------------------------------------------------------------

VACE_MODULE_KINDS = ("fp8_scaled", "gguf_Q8_0")  # a ComfyUI scaled-fp8 module, a GGUF module


def vace_module_file(name: str) -> str:
    """Where the tiny VACE module of kind ``name`` lives in the tree."""
    return f"{KINDS_FOLDER}/wan_tiny_vace_module_{name.removeprefix('gguf_')}{Path(KINDS[name].file).suffix}"


def write_vace_module_kinds(root: Path, module_file: Path) -> dict[str, Path]:
    """The tiny VACE module (only vace_* tensors) in each of ``VACE_MODULE_KINDS``; {kind: path}."""
    state = load_file(str(module_file))
    written = {}
    for name in VACE_MODULE_KINDS:
        written[name] = root / vace_module_file(name)
        KINDS[name].write(state, written[name])
    return written
