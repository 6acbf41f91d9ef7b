"""ComfyUI's model patches on the WanMesh MODEL: what runs on the pool, what runs here, what is refused; runs in the
ComfyUI process.

A native Wan MODEL is changed by ComfyUI's nodes in three ways, and each one has its rule here:

* Weight patches (``ModelPatcher.add_patches``: ``LoraLoaderModelOnly``, ``LoraLoader``'s model half,
  ``comfy.sd.load_lora_for_models`` and the LoRA stacker nodes built on it). ComfyUI matches the LoRA's keys to
  the model's weight names (``diffusion_model.blocks.0.self_attn.q.weight``: the MODEL lists the names and shapes
  of its transformer file without holding a tensor) and hands the low-rank factors here. They are written once,
  unchanged, as a LoRA file in the original key layout (named by their content) and join the model's
  ``(file, strength)`` list, which the ranks merge into their slices exactly as for the WanMesh LoRA Loader
  (factors on kept quantized layers). Other weight adapters (LoHa, LoKr, OFT, DoRA ...) and model merges are
  refused by name.
* Transformer options each model call carries: a DiT block replacement that returns the block's input unchanged
  (``SkipLayerGuidanceDiT``, ``SkipLayerGuidanceDiTSimple``) skips that block on every rank; any other block
  replacement and ``rope_options`` are refused. ``DIFFUSION_MODEL`` wrappers (``EasyCache``) run here around the
  pool call, so they see every model call and its output; the other wrappers, the model-function wrapper
  (``LazyCache``) and the CFG functions already run in ComfyUI's sampling code around the model call.
* Object patches other than model sampling, weight wrappers and hook patches would change weights the pool holds:
  refused. ``TorchCompileModel`` is accepted with a log line: the pool's transformer is not compiled here.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import logging
import math
import os
from pathlib import Path

import torch

from ...parallel.config import cache_root
from ...parallel.weights.checkpoint import COMFY_TRANSFORMER_PREFIX
from ...parallel.weights.detect import read_header

log = logging.getLogger("wanmesh")

MODEL_PREFIX = "diffusion_model."  # ComfyUI's prefix of a BaseModel's transformer weights
LORA_FOLDER = "comfy_loras"
ALLOWED_OBJECT_PATCHES = ("model_sampling",)  # sigma schedule objects: used by ComfyUI's sampling code, here
TORCH_COMPILE_KEY = "torch.compile"
INSTEAD = "use the WanMesh LoRA Loader or a plain LoRA (lora_up/lora_down, diff)"


class SkipBlock:
    """Marker of a block replacement that returns the block's input unchanged."""


# -- the names and shapes ComfyUI's LoRA key map reads ---------------------------------------------------------


@functools.cache
def native_weight_shapes(model_files: tuple[str, ...]) -> dict[str, tuple[int, ...]] | None:
    """ComfyUI's Wan names (without ``diffusion_model.``) -> shape of every tensor of the transformer file(s), read
    from their headers; None for a diffusers folder (ComfyUI's UNETLoader reads single files only)."""
    shapes = {}
    for path in model_files:
        if Path(path).is_dir():
            return None
        for key, shape in read_header(path).shapes.items():
            shapes[key.removeprefix(COMFY_TRANSFORMER_PREFIX)] = tuple(shape)
    return shapes


# -- LoRA patches -> a factors file -----------------------------------------------------------------------------


def lora_source() -> str:
    """The LoRA file name of the loader node calling ``add_patches`` (its ``lora_name`` argument), for messages;
    ComfyUI's patch API passes only tensors, so the caller's frame is the one place that names the file."""
    frame = inspect.currentframe()
    while frame is not None:
        name = frame.f_locals.get("lora_name")
        if isinstance(name, str):
            return name
        frame = frame.f_back
    return "a LoRA"


def _refuse(source: str, what: str) -> ValueError:
    return ValueError(f"LoRA {source}: {what} cannot be applied on the WanMesh MODEL; {INSTEAD}")


def _adapter_tensors(source: str, base: str, is_bias: bool, patch) -> dict[str, torch.Tensor]:
    """The LoRA-file tensors (original key layout) of one ComfyUI weight patch."""
    if isinstance(patch, tuple) and len(patch) == 2 and patch[0] == "diff":
        return {f"{base}.diff_b" if is_bias else f"{base}.diff": patch[1][0]}
    weights = getattr(patch, "weights", None)
    if type(patch).__name__ != "LoRAAdapter" or weights is None:
        kind = patch[0] if isinstance(patch, tuple) and patch and isinstance(patch[0], str) else type(patch).__name__
        raise _refuse(source, f"a {kind} patch (of {base})")
    up, down, alpha, mid, dora_scale, reshape = weights
    if mid is not None or dora_scale is not None or reshape is not None or is_bias:
        raise _refuse(source, f"a LoRA with {'a mid matrix' if mid is not None else 'DoRA scales' if dora_scale is not None else 'reshape' if reshape is not None else 'a bias factor'} (on {base})")
    tensors = {f"{base}.lora_up.weight": up, f"{base}.lora_down.weight": down}
    if alpha is not None:
        tensors[f"{base}.alpha"] = torch.tensor(float(alpha))
    return tensors


def _check_tensor_values(source: str, tensors: dict[str, torch.Tensor]) -> None:
    for key, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise ValueError(f"LoRA {source}: {key} holds NaN or Inf values; the file is damaged")


def _check_fits(source: str, key: str, tensors: dict[str, torch.Tensor], shape: tuple[int, ...]) -> None:
    """The delta a patch adds has the model weight's shape (a LoRA for another model width does not)."""
    up, down = (next((t for k, t in tensors.items() if k.endswith(end)), None) for end in (".lora_up.weight",
                                                                                            ".lora_down.weight"))
    diff = next((t for k, t in tensors.items() if ".diff" in k), None)
    delta = (up.shape[0], math.prod(down.shape[1:])) if up is not None else tuple(diff.shape)
    wanted = (shape[0], math.prod(shape[1:])) if up is not None and len(shape) > 1 else shape
    if tuple(delta) != tuple(wanted) or (up is not None and math.prod(up.shape[1:]) != down.shape[0]):
        raise ValueError(f"LoRA {source}: its delta for {key} has shape {list(delta)}, the model's weight is "
                         f"{list(shape)}; the LoRA is for another model")


def lora_factors(patches: dict, strength_model: float, shapes: dict[str, tuple[int, ...]],
                 source: str) -> tuple[dict[str, torch.Tensor], list]:
    """(the LoRA-file tensors of the patches that name a model weight, those patches' keys); ValueError for what
    the pool cannot apply or a LoRA that does not fit."""
    if strength_model != 1.0:
        raise ValueError(f"{source}: a patch that scales the model's own weights (strength_model {strength_model}, "
                         "model merging) cannot be applied on the WanMesh MODEL; merge the files beforehand")
    tensors, added = {}, []
    for key, patch in patches.items():
        if not isinstance(key, str):
            raise _refuse(source, f"a patch with an offset or function ({key[0]})")
        name = key.removeprefix(MODEL_PREFIX)
        if not key.startswith(MODEL_PREFIX) or name not in shapes:
            continue  # not a transformer weight (a text encoder's, with LoraLoader): ComfyUI reports it
        base, _, kind = name.rpartition(".") if name.endswith((".weight", ".bias")) else (name, "", "weight")
        layer = _adapter_tensors(source, f"{MODEL_PREFIX}{base}", kind == "bias", patch)
        _check_tensor_values(source, layer)
        _check_fits(source, key, layer, shapes[name])
        tensors.update(layer)
        added.append(key)
    return tensors, added


def write_factors(tensors: dict[str, torch.Tensor]) -> Path:
    """The factors as a safetensors LoRA file named by its content (written once; workers read their slices)."""
    from safetensors.torch import save_file

    tensors = {key: value.detach().cpu().contiguous() for key, value in sorted(tensors.items())}
    digest = hashlib.sha256()
    for key, value in tensors.items():
        digest.update(f"{key}:{value.dtype}:{tuple(value.shape)}".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    folder = cache_root() / LORA_FOLDER
    path = folder / f"{digest.hexdigest()[:32]}.safetensors"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        save_file(tensors, str(partial))
        os.replace(partial, path)
    return path


def add_lora_patches(patcher, shapes: dict | None, patches: dict, strength_patch: float,
                     strength_model: float) -> list:
    """``ModelPatcher.add_patches`` of the pool MODEL: the patches become a LoRA file in its transformer options'
    LoRA list (the ranks merge them); returns the keys taken, as ComfyUI's does."""
    source = lora_source()
    if shapes is None:
        raise ValueError(f"LoRA {source}: ComfyUI's LoRA loaders need the WanMesh model as a single file (a "
                         "diffusers folder has other weight names); load the LoRA with the WanMesh LoRA Loader")
    if not patches:
        raise ValueError(f"LoRA {source}: none of its keys fits a layer of this model (ComfyUI lists them as "
                         "'lora key not loaded'); it is for another model")
    tensors, added = lora_factors(patches, strength_model, shapes, source)
    if tensors:
        options = patcher.model_options.setdefault("transformer_options", {})
        path = write_factors(tensors)
        options[POOL_LORAS] = (*options.get(POOL_LORAS, ()), (str(path), float(strength_patch)))
        log.info("WanMesh MODEL: LoRA %s (%d layers, strength %s) goes to the pool", source, len(added),
                 strength_patch)
    return added


POOL_LORAS = "wanmesh_loras"  # transformer option: the (file, strength) list ComfyUI's LoRA loaders added


# -- per-call transformer options ------------------------------------------------------------------------------


def _node_of(function) -> str:
    """The node class that made a patch function (its qualified name up to ``<locals>``)."""
    qualname = getattr(function, "__qualname__", type(function).__name__)
    return qualname.split(".<locals>")[0].split(".")[0]


class _CallsOriginal(Exception):
    pass


def _original_block(*args, **kwargs):
    raise _CallsOriginal


@functools.lru_cache(maxsize=256)
def _is_skip(function) -> bool:
    """Whether a DiT block replacement returns the block's input unchanged (probed with a marker input)."""
    marker = object()
    try:
        out = function({"img": marker, "txt": None, "vec": None, "pe": None, "transformer_options": {}},
                       {"original_block": _original_block})
    except Exception:  # noqa: BLE001 - it runs the block or needs real tensors: not expressible as data
        return False
    return isinstance(out, dict) and out.get("img") is marker


def skipped_blocks(transformer_options: dict) -> list[int]:
    """The DiT blocks a model call skips; ValueError naming the node for a block replacement or RoPE option the
    pool cannot run (ComfyUI's Wan model reads ``("double_block", i)`` replacements only)."""
    if transformer_options.get("rope_options"):
        raise ValueError("the WanMesh MODEL cannot take RoPE options (ScaleROPE): its transformer runs in the worker "
                         "pool; remove the node or use a native model")
    replaced = (transformer_options.get("patches_replace") or {}).get("dit") or {}
    skipped = []
    for key, function in replaced.items():
        if not (isinstance(key, tuple) and key[0] == "double_block"):
            continue  # Wan has double blocks only: native ignores other replacements too
        if not _is_skip(function):
            raise ValueError(f"{_node_of(function)}: the WanMesh MODEL can skip DiT blocks (SkipLayerGuidanceDiT) but "
                             "not run another block replacement; remove the node or use a native model")
        skipped.append(int(key[1]))
    return sorted(skipped)


# -- checks when sampling starts -----------------------------------------------------------------------------


def check_model_patches(patcher) -> None:
    """One-line ValueError for a patch that would change the math but cannot run with the pool's weights."""
    for key in patcher.object_patches:
        if key not in ALLOWED_OBJECT_PATCHES:
            raise ValueError(f"the WanMesh MODEL cannot take an object patch of {key!r} (its transformer runs in the "
                             "worker pool); remove the node that sets it, or use a native model")
    if getattr(patcher, "weight_wrapper_patches", None):
        raise ValueError("the WanMesh MODEL cannot take weight wrappers (its weights live in the worker pool); remove "
                         "the node that adds them")
    if getattr(patcher, "hook_patches", None) or getattr(patcher, "forced_hooks", None):
        raise ValueError("the WanMesh MODEL cannot take hook LoRAs (CreateHookLora, SetClipHooks scheduling); load "
                         "the LoRA with LoraLoaderModelOnly or the WanMesh LoRA Loader")
    for key in getattr(patcher, "injections", None) or {}:  # ComfyUI 0.33's forward injections
        node = INJECTION_NODES.get(key, f"the node that injects {key!r}")
        raise ValueError(f"{node}: the WanMesh MODEL cannot run code injected into its forward (its transformer runs "
                         "in the worker pool); load a LoRA with LoraLoaderModelOnly (the same LoRA, as weight "
                         "patches) or the WanMesh LoRA Loader")
    transformer_options = patcher.model_options.get("transformer_options", {})
    skipped_blocks(transformer_options)
    check_model_function_patches(transformer_options)


# the model patch kinds ComfyUI's Wan models call (comfy/ldm/wan); others (a UNet's input and output block patches)
# are ignored by native Wan too
WAN_PATCH_KINDS = ("attn1_patch", "attn2_patch", "double_block")
# the native nodes that inject code into the model's forward, by the injection's key
INJECTION_NODES = {"bypass_lora": "LoraLoaderBypass / LoraLoaderBypassModelOnly"}
# the native nodes that set the model patches ComfyUI's Wan model calls inside its blocks, by the patch's class
PATCH_NODES = {"MultiTalkCrossAttnPatch": "WanInfiniteTalkToVideo", "MultiTalkGetAttnMapPatch": "WanInfiniteTalkToVideo",
               "WanUni3CCnetPatch": "WanUni3CControlnetApply"}


def check_model_function_patches(transformer_options: dict) -> None:
    """Refuse the functions ComfyUI's Wan model calls inside its blocks (``set_model_patch``: attention and block
    patches, InfiniteTalk's audio cross-attention): the blocks run in the worker pool, which cannot call them."""
    for kind, functions in (transformer_options.get("patches") or {}).items():
        if functions and kind in WAN_PATCH_KINDS:
            name = _node_of(functions[0])
            node = f"{PATCH_NODES[name]} ({name})" if name in PATCH_NODES else name
            raise ValueError(f"{node}: the WanMesh MODEL cannot run a {kind} model patch (its blocks run in the "
                             "worker pool); remove the node, or use a native model")


def drop_torch_compile(wrapper_type: str, key: str) -> bool:
    """Whether a wrapper is TorchCompileModel's (not added: the pool runs the transformer; said in a log line)."""
    if key == TORCH_COMPILE_KEY and wrapper_type == "apply_model":
        log.info("TorchCompileModel on the WanMesh MODEL: nothing is compiled here, the transformer runs in the "
                 "worker pool with its own kernels")
        return True
    return False
