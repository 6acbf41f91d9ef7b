"""A tiny random CLIP vision encoder file for the image-to-video tests (``write_tiny_clip_vision``); runs in the CLI
process (``wanmesh make-tiny``) and tests.

Its width is ViT-H/14's 1280 (Wan's image embedding takes 1280-wide tokens), with 16 heads of 80, 224 px images in
patches of 14 (257 tokens), but only 2 layers and a narrow MLP, stored as float16 in transformers' CLIP naming like
the released ``clip_vision_h.safetensors`` (no metadata: the loader infers everything from shapes). ComfyUI's own
CLIPVisionLoader picks its config by layer count and cannot read it; ComfyUI's model classes built from
``TINY_CLIP_VISION_COMFY`` (its config.json keys) can. Deterministic (a fixed seed); written atomically.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from ..tensor_files import save_tensors_atomic

CLIP_VISION_FILE = "clip_vision/clip_vision_tiny.safetensors"  # relative to a models folder (files.TINY_FILES)
SEED = 20250102
TINY_CLIP_VISION = dict(hidden_size=1280, num_hidden_layers=2, num_attention_heads=16, intermediate_size=512,
                        patch_size=14, image_size=224, num_channels=3, projection_dim=64, hidden_act="gelu",
                        layer_norm_eps=1e-5, attention_dropout=0.0, dropout=0.0)
# ComfyUI's ClipVisionModel config (the keys of its clip_vision_config_h.json) for the same model.
TINY_CLIP_VISION_COMFY = dict(TINY_CLIP_VISION, model_type="clip_vision_model", initializer_factor=1.0,
                              initializer_range=0.02, torch_dtype="float32")
STORED_DTYPE = torch.float16  # as the released file; ComfyUI and WanMesh both compute from the same stored values


def _random_like(name: str, shape: torch.Size, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=generator)
    if "norm" in name and name.endswith("weight"):
        return 1.0 + 0.05 * noise  # LayerNorm scales near one
    if name.endswith("bias") or name.endswith("class_embedding") or "position_embedding" in name:
        return 0.02 * noise
    fan_in = shape[1:].numel()
    return noise * fan_in ** -0.5


def build_tiny_clip_vision(seed: int = SEED) -> CLIPVisionModelWithProjection:
    """The tiny encoder (``TINY_CLIP_VISION``) with seeded random weights (filled in name order), float32."""
    model = CLIPVisionModelWithProjection(CLIPVisionConfig(**TINY_CLIP_VISION))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            parameter.copy_(_random_like(name, parameter.shape, generator).to(STORED_DTYPE))
    return model.eval().requires_grad_(False)


def tiny_clip_vision_state(seed: int = SEED) -> dict[str, torch.Tensor]:
    """The tiny encoder's tensors as the file stores them: transformers' names, float16."""
    return {name: tensor.to(STORED_DTYPE).contiguous()
            for name, tensor in build_tiny_clip_vision(seed).state_dict().items()}


def openclip_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-named CLIP vision state in OpenCLIP's ``visual.*`` layout (fused q/k/v rows, a transposed
    ``proj``): the inverse of ComfyUI's ``convert_to_transformers``, for the layout tests."""
    renamed = {"vision_model.embeddings.class_embedding": "visual.class_embedding",
               "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
               "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
               **{f"vision_model.{old}.{suffix}": f"visual.{new}.{suffix}" for old, new in
                  (("pre_layrnorm", "ln_pre"), ("post_layernorm", "ln_post")) for suffix in ("weight", "bias")}}
    out = {new: state[old] for old, new in renamed.items()}
    out["visual.proj"] = state["visual_projection.weight"].t().contiguous()
    layers = {int(key.split(".")[3]) for key in state if key.startswith("vision_model.encoder.layers.")}
    for layer in sorted(layers):
        old, new = f"vision_model.encoder.layers.{layer}.", f"visual.transformer.resblocks.{layer}."
        for suffix in ("weight", "bias"):
            out[f"{new}attn.in_proj_{suffix}"] = torch.cat([state[f"{old}self_attn.{proj}.{suffix}"]
                                                            for proj in ("q_proj", "k_proj", "v_proj")])
            for old_name, new_name in (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("mlp.fc1", "mlp.c_fc"),
                                       ("mlp.fc2", "mlp.c_proj"), ("self_attn.out_proj", "attn.out_proj")):
                out[f"{new}{new_name}.{suffix}"] = state[f"{old}{old_name}.{suffix}"]
    if len(out) != len(state) - 4 * len(layers):  # each layer's 6 q/k/v tensors are 2 fused ones
        raise RuntimeError(f"the OpenCLIP layout has {len(out)} tensors for {len(state)} in transformers' naming")
    return out


def write_tiny_clip_vision(path: str | Path, seed: int = SEED) -> Path:
    """Write the tiny CLIP vision file to ``path`` (atomically; missing folders made); returns the path."""
    return save_tensors_atomic(tiny_clip_vision_state(seed), path)
