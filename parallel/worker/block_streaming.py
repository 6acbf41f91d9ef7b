"""Transformer blocks streamed from host memory when a rank's share of a model exceeds its memory budget; runs in
the workers (``residency.py`` applies it at load, from outside the model, on every layout).

``BlockSizes.from_file`` estimates from the file's header alone, before any weight is read, what the rank will hold:
each block's bytes (transformer and VACE blocks) and the rest (embeddings, head, modulation, the rotary tables), in
the compute dtype (float32 for the modules the model keeps in float32), quantized tensors kept at about one byte
per value, block matrices divided by the tensor-parallel degree.
``plan_streaming`` decides: resident when everything fits the budget; streamed when the rest plus two blocks (the
one running and the one being fetched) fit; else a one-line refusal naming the block size and the budget.

``BlockStreamer`` keeps every block's tensors in host memory (pinned on CUDA) and gives a block device copies just
before it runs (a forward pre-hook), fetching the next block meanwhile (on a side CUDA stream, waited for by
an event before that block runs), and drops the copies after it ran (a forward hook); a forward hook on the whole
model drops whatever a step cache's skipped blocks left fetched. The weights are the same tensors, so the results
equal a resident run's. On the CPU host and device memory are the same: the copies are made all the same (the
mechanism and ``bytes_moved`` are what a CPU shows; the time is a GPU's to measure).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch
from diffusers import WanTransformer3DModel

BLOCK_NAME = re.compile(r"^((?:vace_)?blocks\.\d+)\.")
QUANTIZED_BYTES_PER_VALUE = 1  # fp8 and Q8_0 (1.06); fewer-bit GGUF types take less: an upper bound for those
IN_FLIGHT_BLOCKS = 2  # the running block and the one fetched meanwhile
FLOAT32_MODULES = frozenset(WanTransformer3DModel._keep_in_fp32_modules)
ROPE_MAX_SEQ_LEN = 1024  # diffusers' default for Wan


@dataclass(frozen=True)
class BlockSizes:
    """What a rank will hold of a transformer, estimated from the header (see the module)."""

    blocks: dict[str, int]  # block prefix -> bytes
    rest: int

    @property
    def total(self) -> int:
        return self.rest + sum(self.blocks.values())

    @property
    def largest_block(self) -> int:
        return max(self.blocks.values(), default=0)

    @classmethod
    def from_source(cls, source, dtype: torch.dtype, keep_quantized: bool, tp: int, config: dict | None = None
                    ) -> BlockSizes:
        blocks: dict[str, int] = {}
        rest = rope_buffer_bytes(config or {})
        for name in source.names():
            shape = source.shape(name)
            size = math.prod(shape) * bytes_per_value(name, dtype, keep_quantized and source.is_quantized(name))
            match = BLOCK_NAME.match(name)
            if match is None:
                rest += size
            else:
                blocks[match.group(1)] = blocks.get(match.group(1), 0) + (size // tp if len(shape) == 2 else size)
        return cls(blocks, rest)

    @classmethod
    def from_file(cls, path: str, vace_module: str | None, dtype: torch.dtype, weights: str, tp: int) -> BlockSizes:
        from ..weights.loaders import transformer_weight_source

        with contextlib.ExitStack() as stack:
            _, config, source = transformer_weight_source(path, vace_module, stack)
            return cls.from_source(source, dtype, weights == "keep", tp, config)


def bytes_per_value(name: str, dtype: torch.dtype, kept_quantized: bool) -> int:
    """What a rank holds per value of the tensor ``name``: about one byte kept quantized; four in the modules the
    model keeps in float32 whatever the compute dtype (diffusers' ``_keep_in_fp32_modules``: the time embedder,
    the modulation tables, the norms); else the compute dtype's size."""
    if kept_quantized:
        return QUANTIZED_BYTES_PER_VALUE
    if dtype.itemsize < 4 and FLOAT32_MODULES.intersection(name.split(".")):
        return 4
    return dtype.itemsize


def rope_buffer_bytes(config: dict) -> int:
    """The rotary tables the model builds (cosine and sine, float32, ``rope_max_seq_len`` x head width); they are
    in no file."""
    head_width = config.get("attention_head_dim", 0)
    return 2 * config.get("rope_max_seq_len", ROPE_MAX_SEQ_LEN) * head_width * 4


def plan_streaming(sizes: BlockSizes, budget_bytes: int, what: str) -> bool:
    """Whether the model must be streamed block by block to fit ``budget_bytes``; refuses (ValueError, one line)
    a model that cannot fit even so."""
    if sizes.total <= budget_bytes:
        return False
    needed = sizes.rest + IN_FLIGHT_BLOCKS * sizes.largest_block
    if needed > budget_bytes:
        raise ValueError(
            f"{what}: does not fit the memory budget of {size_text(budget_bytes)} per rank even streamed block by "
            f"block: its blocks take {size_text(sizes.largest_block)} each and the rest {size_text(sizes.rest)} "
            f"(streaming holds the rest and {IN_FLIGHT_BLOCKS} blocks, {size_text(needed)}); raise "
            f"memory_budget_gb, add tensor-parallel ranks, or use a quantized file")
    return True


def size_text(size: int) -> str:
    """Bytes for a message: GB with two decimals, or MB below a tenth of a GB."""
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"


class BlockStreamer:
    """Streams a model's blocks from host memory into ``device`` (see the module); ``bytes_moved`` counts the
    bytes copied in, ``device_bytes`` what the model holds on the device between forwards."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = torch.device(device)
        # in the order they run: a VACE model computes its hints before the main blocks
        self.blocks = [module for name in ("vace_blocks", "blocks") for module in getattr(model, name, None) or ()]
        self.tensors = [self._host_tensors(block) for block in self.blocks]
        self.order = {id(block): index for index, block in enumerate(self.blocks)}
        self.fetched: dict[int, object] = {}  # block index -> CUDA event (None on the CPU)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.bytes_moved = 0
        self.block_bytes = [sum(tensor.nbytes for _, _, tensor in tensors) for tensors in self.tensors]
        for block in self.blocks:
            block.register_forward_pre_hook(self._before_block)
            block.register_forward_hook(self._after_block)
        model.register_forward_hook(lambda *args: self._release_all())
        inside = {id(module) for block in self.blocks for module in block.modules()}
        self.rest = [(module, name) for module in model.modules() if id(module) not in inside
                     for table in (module._parameters, module._buffers) for name, tensor in table.items()
                     if tensor is not None]
        rest_bytes = sum(_tensor(module, name).nbytes for module, name in self.rest)
        # the most the device holds during a forward: everything but the blocks, and the blocks in flight
        self.device_bytes = rest_bytes + IN_FLIGHT_BLOCKS * max(self.block_bytes, default=0)

    def _host_tensors(self, block: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        """(module, name, host tensor) of every parameter and buffer of ``block``, its own held on the host."""
        held = []
        for module in block.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    host = tensor.detach().cpu()
                    if self.device.type == "cuda":
                        host = host.pin_memory()
                    self._assign(module, name, host)
                    held.append((module, name, host))
        return held

    @staticmethod
    def _assign(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
        if name in module._parameters:
            module._parameters[name].data = value
        else:
            module._buffers[name] = value

    def _fetch(self, index: int) -> None:
        """Device copies of block ``index``'s tensors (on the side stream on CUDA, recording when they are in)."""
        if index in self.fetched or index >= len(self.blocks):
            return
        context = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with context:
            for module, name, host in self.tensors[index]:
                self._assign(module, name, host.to(self.device, non_blocking=True) if self.stream is not None
                             else host.clone())
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self.bytes_moved += self.block_bytes[index]
        self.fetched[index] = event

    def _before_block(self, block, args) -> None:
        index = self.order[id(block)]
        self._fetch(index)
        event = self.fetched[index]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        self._fetch(index + 1)  # overlaps with this block's compute on CUDA

    def _after_block(self, block, args, output) -> None:
        self._release(self.order[id(block)])

    def _release(self, index: int) -> None:
        if index not in self.fetched:
            return
        del self.fetched[index]
        for module, name, host in self.tensors[index]:
            self._assign(module, name, host)

    def _release_all(self) -> None:
        for index in list(self.fetched):
            self._release(index)


def stream_blocks(model: torch.nn.Module, device: torch.device) -> BlockStreamer:
    """Apply block streaming to a loaded model (in place): its blocks held on the host, everything else on
    ``device``; returns the streamer (kept on the model as ``block_streamer``)."""
    streamer = BlockStreamer(model, device)
    for module, name in streamer.rest:
        tensor = _tensor(module, name)
        if tensor.device != streamer.device:
            BlockStreamer._assign(module, name, tensor.to(streamer.device))
    model.block_streamer = streamer
    return streamer


def _tensor(module: torch.nn.Module, name: str) -> torch.Tensor:
    return module._parameters[name] if name in module._parameters else module._buffers[name]
