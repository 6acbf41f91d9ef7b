"""Counting of torch.distributed traffic, for benchmarks and for tests that check communication volume;
runs in the workers and benchmark ranks.

`CollectiveCounter` temporarily wraps the point-to-point and collective functions of
`torch.distributed` in this process and records, per operation name, the number of calls and
the bytes this rank sends and receives. Collectives are counted with the volume a
bandwidth-optimal algorithm moves per rank (ring all-gather / reduce-scatter / all-reduce,
direct all-to-all), which is what analytic communication models use; point-to-point
operations are counted exactly.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from .groups import group_size_and_rank

# (bytes sent, bytes received) by this rank for one call, from the call's bound arguments.
_ByteRule = Callable[[inspect.BoundArguments], tuple[int, int]]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_size_and_rank(arguments: dict[str, Any]) -> tuple[int, int]:
    return group_size_and_rank(arguments.get("group"))


def _send_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    return _nbytes(bound.arguments["tensor"]), 0


def _recv_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    return 0, _nbytes(bound.arguments["tensor"])


def _broadcast_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    arguments = bound.arguments
    size = _nbytes(arguments["tensor"])
    group = arguments.get("group")
    src = arguments.get("group_src")
    if src is None:
        src = dist.get_group_rank(group, arguments["src"]) if group is not None else arguments["src"]
    return (size, 0) if dist.get_rank(group) == src else (0, size)


def _all_reduce_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    world, _ = _group_size_and_rank(bound.arguments)
    moved = 2 * (world - 1) * _nbytes(bound.arguments["tensor"]) // world
    return moved, moved


def _all_gather_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    arguments = bound.arguments
    world, _ = _group_size_and_rank(arguments)
    local = arguments["tensor"] if "tensor" in arguments else arguments["input_tensor"]
    moved = (world - 1) * _nbytes(local)
    return moved, moved


def _reduce_scatter_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    arguments = bound.arguments
    world, _ = _group_size_and_rank(arguments)
    if "input_list" in arguments:
        total = sum(_nbytes(t) for t in arguments["input_list"])
    else:
        total = _nbytes(arguments["input"])
    moved = (world - 1) * total // world
    return moved, moved


def _all_to_all_single_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    arguments = bound.arguments
    world, rank = _group_size_and_rank(arguments)

    def off_rank_bytes(tensor: torch.Tensor, splits: list[int] | None) -> int:
        total = _nbytes(tensor)
        if not splits:
            return total - total // world
        row_bytes = total // max(tensor.shape[0], 1)
        return total - splits[rank] * row_bytes

    sent = off_rank_bytes(arguments["input"], arguments.get("input_split_sizes"))
    received = off_rank_bytes(arguments["output"], arguments.get("output_split_sizes"))
    return sent, received


def _all_to_all_rule(bound: inspect.BoundArguments) -> tuple[int, int]:
    arguments = bound.arguments
    _, rank = _group_size_and_rank(arguments)
    inputs, outputs = arguments["input_tensor_list"], arguments["output_tensor_list"]
    sent = sum(_nbytes(t) for i, t in enumerate(inputs) if i != rank)
    received = sum(_nbytes(t) for i, t in enumerate(outputs) if i != rank)
    return sent, received


_BYTE_RULES: dict[str, _ByteRule] = {
    "send": _send_rule,
    "isend": _send_rule,
    "recv": _recv_rule,
    "irecv": _recv_rule,
    "broadcast": _broadcast_rule,
    "all_reduce": _all_reduce_rule,
    "all_gather": _all_gather_rule,
    "all_gather_into_tensor": _all_gather_rule,
    "all_gather_single": _all_gather_rule,
    "reduce_scatter": _reduce_scatter_rule,
    "reduce_scatter_tensor": _reduce_scatter_rule,
    "reduce_scatter_single": _reduce_scatter_rule,
    "all_to_all": _all_to_all_rule,
    "all_to_all_single": _all_to_all_single_rule,
}


class CollectiveCounter:
    """Context manager counting calls and bytes of torch.distributed operations in this process.

    While active, `torch.distributed.<op>` for every op in `_BYTE_RULES` is replaced by a
    counting wrapper (also inside `distributed_c10d`, so `P2POp(dist.isend, ...)` built inside
    the context passes PyTorch's op check and `batch_isend_irecv` is counted per send/recv).
    Code must look the functions up as `dist.<op>` at call time to be counted. A wrapped op
    that calls another (e.g. `all_gather_into_tensor` -> `all_gather_single`) counts once.
    Not thread-safe; nesting counters is not supported.

    Attributes:
        calls: op name -> number of calls.
        sent: op name -> bytes this rank sent.
        received: op name -> bytes this rank received.
        seconds: op name -> wall seconds spent in the calls (``synchronize``: CUDA work is waited for before and
            after each call, so that asynchronous NCCL calls are timed whole; the run's breakdown uses it).
    """

    def __init__(self, synchronize: torch.device | None = None) -> None:
        self.calls: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self._synchronize = synchronize if synchronize is not None and synchronize.type == "cuda" else None
        self._originals: dict[str, Callable[..., Any]] = {}
        self._inside_op = False

    @property
    def total_sent(self) -> int:
        return sum(self.sent.values())

    @property
    def total_received(self) -> int:
        return sum(self.received.values())

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        """Per-op counts as plain dicts: {op: {"calls": n, "sent": bytes, "received": bytes}}."""
        return {
            name: {"calls": self.calls[name], "sent": self.sent[name], "received": self.received[name]}
            for name in sorted(self.calls)
        }

    def reset(self) -> None:
        self.calls.clear()
        self.sent.clear()
        self.received.clear()
        self.seconds.clear()

    def __enter__(self) -> CollectiveCounter:
        if getattr(dist.isend, "_counted_by", None) is not None:
            raise RuntimeError("a CollectiveCounter is already active; nesting is not supported")
        for name, rule in _BYTE_RULES.items():
            original = getattr(distributed_c10d, name, None)
            if original is None:
                continue
            self._originals[name] = original
            wrapper = self._counting_wrapper(name, original, rule)
            setattr(distributed_c10d, name, wrapper)
            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for name, original in self._originals.items():
            setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _counting_wrapper(
        self, name: str, original: Callable[..., Any], rule: _ByteRule
    ) -> Callable[..., Any]:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._inside_op:  # called by another counted op: already counted there
                return original(*args, **kwargs)
            sent, received = rule(signature.bind(*args, **kwargs))
            self.calls[name] += 1
            self.sent[name] += sent
            self.received[name] += received
            self._inside_op = True
            self._wait()
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._wait()
                self.seconds[name] += time.perf_counter() - start
                self._inside_op = False

        counted._counted_by = self  # type: ignore[attr-defined]

        return counted

    def _wait(self) -> None:
        if self._synchronize is not None:
            torch.cuda.synchronize(self._synchronize)
