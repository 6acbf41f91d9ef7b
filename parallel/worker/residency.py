"""The models resident on one rank, keyed by kind, file and options; runs in a worker process.

Loading applies this rank's parallel plans from outside the single-device model code: tensor-parallel
sharded loading when tp > 1, then the context-parallel plan when ring x ulysses > 1. Models stay resident
between requests until unloaded.

Memory budget: the resident models of a rank are kept within ``budget_bytes`` (``ParallelConfig
.memory_budget_gb``; 0 = what the device can hold, ``memory.py``). Loading a model that does not fit first
unloads the least recently used other models (logged). Every handle keeps its recipe, so a handle whose model
was unloaded (by the budget, or by ComfyUI's "unload models") is loaded again when a request next uses it. A
transformer whose share exceeds the budget on its own streams its blocks from host memory
(``block_streaming.py``), decided from the file's header before any weight is read.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from ..config import DTYPE_NAMES, check_weights_mode
from ..weights import loaders as wan
from ..weights import umt5_files
from .block_streaming import BlockSizes, plan_streaming, stream_blocks
from .memory import estimated_load_bytes, memory_budget_bytes, resident_bytes, return_freed_heap

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(DTYPES) == DTYPE_NAMES[1:], "config.DTYPE_NAMES and DTYPES must list the same dtypes"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on accelerators and fp32 on the CPU (CPU half-precision kernels are slow and inexact)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is unknown; valid: {', '.join(DTYPE_NAMES)}")
    return DTYPES[name]


class ResidentModels:
    """The models loaded on this rank's device, with this rank's parallel plans applied."""

    def __init__(self, device: str | torch.device = "cpu", parallel=None):
        self.device = torch.device(device)
        self.parallel = parallel  # ParallelContext of this rank, or None for one rank without process groups
        self._model_files: dict[str, tuple[str, str | None]] = {}  # transformer handle -> (file, VACE module)
        self._models: OrderedDict[str, object] = OrderedDict()  # least recently used first
        self._recipes: dict[str, tuple[Callable[[], object], int]] = {}  # handle -> (make, estimated bytes)
        self._sizes: dict[str, int] = {}
        self.evictions: list[str] = []  # handles the budget unloaded, oldest first
        config = getattr(parallel, "config", None)
        self.budget_bytes = memory_budget_bytes(getattr(config, "memory_budget_gb", 0.0), self.device,
                                                ranks_on_machine=getattr(config, "world", 1))

    def _degree(self, dim: str) -> int:
        return self.parallel.size(dim) if self.parallel is not None and self.parallel.is_distributed else 1

    # -- loading ---------------------------------------------------------------------------------------

    def _load(self, key: str, make: Callable[[], object], paths: tuple[str | None, ...] = ()) -> str:
        """Make the model once; room is made first (LRU unloads) from the files' size, then checked again with
        the size actually resident."""
        if key not in self._recipes:
            self._recipes[key] = (make, estimated_load_bytes(paths, shards=self._degree("tp")))
        if key in self._models:
            self._models.move_to_end(key)
            return key
        make, estimate = self._recipes[key]
        self._evict_until_fits(self._sizes.get(key, estimate), keep=key)
        self._models[key] = make()
        self._sizes[key] = resident_bytes(self._models[key])
        self._evict_until_fits(0, keep=key)
        return key

    def _evict_until_fits(self, incoming: int, keep: str) -> None:
        """Unload least recently used models other than ``keep`` until ``incoming`` more bytes fit the budget."""
        unloaded = False
        for victim in [key for key in self._models if key != keep]:
            if self.resident_bytes() + incoming <= self.budget_bytes:
                break
            self._models.pop(victim)
            unloaded = True
            self.evictions.append(victim)
            log.warning("memory budget %.1f MB per rank: unloaded %s (%.1f MB) to make room for %s",
                        self.budget_bytes / 1e6, victim, self._sizes.get(victim, 0) / 1e6, keep)
        if unloaded:
            self._collect_garbage()

    def _collect_garbage(self) -> None:
        import gc

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return_freed_heap()

    def resident_bytes(self) -> int:
        """Bytes of weights held by the resident models of this rank."""
        return sum(self._sizes.get(key, 0) for key in self._models)

    def load_model(self, path: str, *, vace_module: str | None = None, dtype: str = "auto", weights: str = "keep") -> str:
        """A transformer; ``weights`` (``config.WEIGHT_MODES``) says whether quantized weights stay as stored."""
        check_weights_mode(weights)
        torch_dtype = resolve_dtype(dtype, self.device)
        key = f"model|{path}|{vace_module or ''}|{torch_dtype}|{weights}"
        self._model_files[key] = (path, vace_module)
        return self._load(key, lambda: self._load_transformer(path, vace_module, torch_dtype, weights), (path, vace_module))

    def _load_transformer(self, path: str, vace_module: str | None, torch_dtype: torch.dtype, weights: str):
        """The transformer, tensor-parallel when tp > 1, then with its sequence split when ring x ulysses > 1, and
        its per-frame encoders (Animate's motion encoder) split over the frames when tp x ring x ulysses > 1."""
        if self._degree("tp") * self._degree("ulysses") > 1:  # heads split over these: check before reading weights
            self.parallel.config.check_heads(transformer_heads(path, vace_module))
        streamed = self._streams_blocks(path, vace_module, torch_dtype, weights)
        device = torch.device("cpu") if streamed else self.device  # streamed blocks stay on the host
        if self._degree("tp") == 1:
            model = wan.load_transformer(path, vace_module=vace_module, dtype=torch_dtype, device=device,
                                         weights=weights)
        else:
            from ..weights.sharded import load_transformer_tp

            model = load_transformer_tp(path, vace_module=vace_module, dtype=torch_dtype, device=device,
                                        tp_group=self.parallel.tp_group, weights=weights)
        if streamed:  # before the plans below, which find the model's device from its (non-block) parameters
            streamer = stream_blocks(model, self.device)
            log.info("%s: streamed block by block from host memory (memory budget %.2f GB per rank; on the device "
                     "at most %.2f GB)", path, self.budget_bytes / 1e9, streamer.device_bytes / 1e9)
        if self._degree("ring") * self._degree("ulysses") > 1:
            from ..distributed.context_parallel import apply_context_parallel

            apply_context_parallel(model, ring_group=self.parallel.ring_group, ulysses_group=self.parallel.ulysses_group)
        if self._degree("tp") * self._degree("ring") * self._degree("ulysses") > 1:  # the ranks of one pass
            from ..distributed.frame_split import apply_frame_split

            apply_frame_split(model, [self.parallel.tp_group, self.parallel.ring_group, self.parallel.ulysses_group])
        return model

    def _streams_blocks(self, path: str, vace_module: str | None, dtype: torch.dtype, weights: str) -> bool:
        """Whether this rank's share of the transformer must stream its blocks to fit the memory budget (from the
        file's header, before any weight is read; a model that cannot fit even so is refused). On the CPU, where
        host and device memory are one, only an explicit ``memory_budget_gb`` streams; past the default budget the
        model loads with a warning."""
        sizes = BlockSizes.from_file(path, vace_module, dtype, weights, self._degree("tp"))
        explicit = getattr(getattr(self.parallel, "config", None), "memory_budget_gb", 0.0) > 0
        if self.device.type == "cpu" and not explicit:
            if sizes.total > self.budget_bytes:
                log.warning("%s: this rank's share (about %.2f GB) exceeds its memory budget of %.2f GB; loading it "
                            "whole (set memory_budget_gb to stream its blocks)", path, sizes.total / 1e9,
                            self.budget_bytes / 1e9)
            return False
        return plan_streaming(sizes, self.budget_bytes, Path(path).name)

    def load_vae(self, path: str, *, dtype: str = "auto") -> str:
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(f"vae|{path}|{torch_dtype}", lambda: wan.load_vae(path, dtype=torch_dtype, device=self.device),
                          (path,))

    def load_text_encoder(self, path: str, *, dtype: str = "auto") -> str:
        """umT5, tensor-parallel over the tp group when tp > 1 (then every rank of the group encodes together)."""
        torch_dtype = resolve_dtype(dtype, self.device)
        return self._load(f"text|{path}|{torch_dtype}", lambda: self._load_umt5(path, torch_dtype), (path,))

    def _load_umt5(self, path: str, torch_dtype: torch.dtype):
        if self._degree("tp") == 1:
            return umt5_files.load_text_encoder(path, dtype=torch_dtype, device=self.device)
        from ..weights.umt5_files import load_text_encoder_tp

        return load_text_encoder_tp(path, dtype=torch_dtype, device=self.device, tp_group=self.parallel.tp_group)

    def unload(self, handle: str | None = None) -> None:
        """Free the weights (all of them without a handle); the recipes stay, so a later use loads them again."""
        if handle is None:
            self._models.clear()
        else:
            self._models.pop(handle, None)
        self._collect_garbage()

    def loaded(self) -> list[str]:
        return list(self._models)

    def _get(self, handle: str, kind: str):
        if handle not in self._models and handle in self._recipes and handle.startswith(kind + "|"):
            self._load(handle, self._recipes[handle][0])  # unloaded by the budget or "unload models": load again
        if handle not in self._models:
            raise KeyError(f"no {kind} is loaded under {handle!r}; load it first (loaded: {self.loaded() or 'nothing'})")
        if not handle.startswith(kind + "|"):
            raise TypeError(f"{handle!r} is not a {kind}")
        self._models.move_to_end(handle)
        return self._models[handle]

    def apply_loras(self, handle: str, loras) -> None:
        """Make ``loras`` ((file, strength) pairs, in order) the LoRAs merged into the resident model ``handle``;
        only the difference to what is merged now is done (nothing when unchanged)."""
        from .lora_merge import apply_loras

        model = self._get(handle, "model")
        path, vace_module = self._model_files[handle]
        apply_loras(model, loras, path=path, vace_module=vace_module)


def transformer_heads(path: str, vace_module: str | None = None) -> int:
    """The attention head count of a transformer file or folder, read from its config without loading weights."""
    with contextlib.ExitStack() as stack:
        model_class, config, _ = wan.transformer_weight_source(path, vace_module, stack)
    default = inspect.signature(model_class.__init__).parameters["num_attention_heads"].default
    return int(config.get("num_attention_heads", default))
