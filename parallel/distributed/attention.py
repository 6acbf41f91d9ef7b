"""Attention in the workers: the one local kernel seam, ring attention, Ulysses and USP.

All functions take and return the diffusers layout `[batch, seq, heads, head_dim]` and are
inference-only (no autograd support is intended).

* `attention` is the single local kernel seam. It returns the output and, on request, the
  log-sum-exp of the scores (`[batch, heads, seq]`), which context parallel needs to merge
  partial results. Backends: PyTorch's flash-for-CPU SDPA on CPU; flash-attn (optional,
  imported lazily), PyTorch flash / cuDNN / memory-efficient SDPA on CUDA; a plain `math`
  fallback anywhere.
* `ring_attention`: each rank holds its slice of the sequence; key/value blocks travel
  around the ring (asynchronous send/receive into a double buffer while the current block is
  attended) and block results merge with a log-sum-exp update.
* `ulysses_attention`: all-to-all from sequence-split to head-split, local (or ring, for USP)
  attention over the whole sequence, all-to-all back.

Sequences padded to a multiple of the parallel degree pass `valid_kv_len`: keys at global
positions at or beyond it get no weight. Padding is always a suffix, so a block is either
sliced (padding at its end) or skipped (all padding); no mask is needed and the merge is exact.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable

import torch
import torch.distributed as dist

from .groups import group_size_and_rank

BACKENDS = ("cpu_flash", "flash_attn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "math")

# A backend takes q, k, v in [B, S, H, D] and a softmax scale, and returns
# (out [B, S, H, D] in the input dtype, lse [B, H, S]).
_Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]

_HALF_DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------
# Local kernel seam
# --------------------------------------------------------------------------------------


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _heads_first(q), _heads_first(k), _heads_first(v), scale=scale
    )
    return _heads_first(out), lse


def _sdpa_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    results = torch.ops.aten._scaled_dot_product_flash_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), scale=scale
    )
    return _heads_first(results[0]), results[1]


def _sdpa_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    results = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, scale=scale
    )
    lse = results[1]
    if lse.dim() == 4:  # some cuDNN versions return [B, H, S, 1]
        lse = lse.squeeze(-1)
    return _heads_first(results[0]), lse


def _sdpa_efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    results = torch.ops.aten._scaled_dot_product_efficient_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), None, True, scale=scale
    )
    # The memory-efficient kernel pads the lse's sequence dimension to its tile size.
    return _heads_first(results[0]), results[1][..., : q.shape[1]]


def _flash_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    flash_attn_func = _flash_attn_func()
    if flash_attn_func is None:
        raise RuntimeError("attention backend 'flash_attn' needs the flash-attn package, which is not installed")
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    return out, lse


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute_dtype), k.to(compute_dtype)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v.to(compute_dtype))
    return out.to(q.dtype), lse


_KERNELS: dict[str, _Kernel] = {
    "cpu_flash": _cpu_flash,
    "flash_attn": _flash_attn,
    "sdpa_flash": _sdpa_flash,
    "sdpa_cudnn": _sdpa_cudnn,
    "sdpa_efficient": _sdpa_efficient,
    "math": _math,
}


@functools.cache
def _flash_attn_func() -> Callable | None:
    """flash-attn's `flash_attn_func` when the optional package is installed, else None."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return importlib.import_module("flash_attn").flash_attn_func
    except (ImportError, AttributeError, OSError):  # installed but built for another torch/CUDA
        return None


def select_backend(query: torch.Tensor) -> str:
    """The default attention backend for tensors like `query` (device and dtype)."""
    if query.device.type == "cpu":
        return "cpu_flash"
    if query.device.type != "cuda":
        return "math"
    if query.dtype in _HALF_DTYPES:
        if _flash_attn_func() is not None:
            return "flash_attn"
        # PyTorch's flash kernel needs Ampere or newer; older GPUs use the memory-efficient one.
        if torch.cuda.get_device_capability(query.device) >= (8, 0):
            return "sdpa_flash"
        return "sdpa_efficient"
    if query.dtype == torch.float32:
        return "sdpa_efficient"
    return "math"


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim]; got shape {tuple(tensor.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(
            "q and k must agree in batch, heads and head_dim; "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            "q, k and v must share dtype and device; got "
            f"{q.dtype}/{q.device}, {k.dtype}/{k.device}, {v.dtype}/{v.device}"
        )


def _resolve_backend(backend: str | None, query: torch.Tensor) -> _Kernel:
    name = backend or select_backend(query)
    if name not in _KERNELS:
        raise ValueError(f"unknown attention backend {name!r}; valid: {', '.join(BACKENDS)}")
    return _KERNELS[name]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding: int = 0,
    return_lse: bool = False,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `q` over `k`/`v`, all `[batch, seq, heads, head_dim]`.

    `key_padding` trailing key positions are ignored. Returns `out` (dtype of `q`) or, with
    `return_lse`, `(out, lse)` where `lse` is `[batch, heads, q_seq]` in float32 (float64 for
    float64 inputs). `scale` defaults to `head_dim ** -0.5`; `backend` (one of `BACKENDS`)
    defaults to `select_backend(q)`.
    """
    _check_qkv(q, k, v)
    kv_len = k.shape[1]
    if not 0 <= key_padding < kv_len:
        raise ValueError(f"key_padding must be in [0, {kv_len - 1}] for {kv_len} keys; got {key_padding}")
    kernel = _resolve_backend(backend, q)
    if key_padding:
        k, v = k[:, : kv_len - key_padding], v[:, : kv_len - key_padding]
    out, lse = kernel(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    if not return_lse:
        return out
    return out, lse.to(torch.promote_types(q.dtype, torch.float32))


# --------------------------------------------------------------------------------------
# Ring attention
# --------------------------------------------------------------------------------------


class _LseMerger:
    """Accumulates block attention results; merging by log-sum-exp makes the result exact."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # [B, S, H, D], accumulation dtype
        self.lse: torch.Tensor | None = None  # [B, H, S]

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        out = out.to(lse.dtype)
        if self.out is None:
            self.out, self.lse = out, lse
            return
        merged_lse = torch.logaddexp(self.lse, lse)
        keep = torch.exp(self.lse - merged_lse).transpose(1, 2).unsqueeze(-1)
        take = torch.exp(lse - merged_lse).transpose(1, 2).unsqueeze(-1)
        self.out = self.out * keep + out * take
        self.lse = merged_lse

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        if self.out is None:
            raise RuntimeError("no attention block was merged")
        return self.out.to(dtype)


def _check_valid_len(valid_kv_len: int | None, padded_len: int) -> int:
    if valid_kv_len is None:
        return padded_len
    if not 1 <= valid_kv_len <= padded_len:
        raise ValueError(
            f"valid_kv_len must be in [1, {padded_len}] (the padded global key length); got {valid_kv_len}"
        )
    return valid_kv_len


def _start_ring_shift(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None, next_peer: int, prev_peer: int
) -> list[dist.Work]:
    """Posts the send of `send` to the next rank and the receive of `recv` from the previous one.

    On accelerators (NCCL) the pair must be launched as one group, or two neighbours that both
    send first can block each other; `batch_isend_irecv` does that. Gloo (CPU) cannot coalesce:
    `batch_isend_irecv` would only issue the same isend/irecv one by one, so CPU tensors use
    them directly (gloo runs them asynchronously).
    """
    if send.device.type != "cpu":
        ops = [
            dist.P2POp(dist.isend, send, next_peer, group),
            dist.P2POp(dist.irecv, recv, prev_peer, group),
        ]
        return dist.batch_isend_irecv(ops)
    works = [dist.isend(send, next_peer, group), dist.irecv(recv, prev_peer, group)]
    return [work for work in works if work is not None]


def _wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    valid_kv_len: int | None = None,
    overlap: bool = True,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys/values of all ranks in `group`.

    `q`, `k`, `v` are this rank's slice of the sequence, `[batch, seq_local, heads, head_dim]`;
    every rank holds the same `seq_local` and rank `i` of `group` holds slice `i`.
    `valid_kv_len` is the true global key length; keys at global positions at or beyond it
    (the padding) get no weight. With `overlap` the next block's transfer runs while the
    current block is attended; without it each transfer happens after the block.
    """
    _check_qkv(q, k, v)
    world, rank = group_size_and_rank(group)
    block_len = k.shape[1]
    valid_len = _check_valid_len(valid_kv_len, world * block_len)
    if world == 1:
        return attention(q, k, v, key_padding=block_len - valid_len, scale=scale, backend=backend)

    next_peer = dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    prev_peer = dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    # k and v travel as one tensor: one message per step instead of two.
    local_kv = torch.stack((k, v))
    buffers = (local_kv, torch.empty_like(local_kv))
    merger = _LseMerger()
    for step in range(world):
        current, incoming = buffers[step % 2], buffers[(step + 1) % 2]
        last_step = step == world - 1
        pending = _start_ring_shift(current, incoming, group, next_peer, prev_peer) if overlap and not last_step else []
        source = (rank - step) % world
        valid_in_block = min(max(valid_len - source * block_len, 0), block_len)
        if valid_in_block:  # a block made only of padding contributes nothing
            out, lse = attention(
                q, current[0], current[1], key_padding=block_len - valid_in_block,
                return_lse=True, scale=scale, backend=backend,
            )
            merger.add(out, lse)
        if not overlap and not last_step:
            pending = _start_ring_shift(current, incoming, group, next_peer, prev_peer)
        _wait_all(pending)
    return merger.result(q.dtype)


# --------------------------------------------------------------------------------------
# Ulysses and USP
# --------------------------------------------------------------------------------------


def _sequence_to_heads(stacked: torch.Tensor, group: dist.ProcessGroup | None, degree: int) -> torch.Tensor:
    """[n, B, s, H, D] sequence slices -> [n, B, degree * s, H / degree, D] head slices."""
    n, batch, seq, heads, dim = stacked.shape
    send = stacked.reshape(n, batch, seq, degree, heads // degree, dim).permute(3, 0, 1, 2, 4, 5).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds rank j's sequence slice of this rank's heads.
    return recv.permute(1, 2, 0, 3, 4, 5).reshape(n, batch, degree * seq, heads // degree, dim)


def _heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None, degree: int) -> torch.Tensor:
    """[B, degree * s, H / degree, D] head slices -> [B, s, H, D] sequence slices."""
    batch, full_seq, head_slice, dim = x.shape
    seq = full_seq // degree
    send = x.reshape(batch, degree, seq, head_slice, dim).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds this rank's sequence slice of rank j's heads.
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, seq, degree * head_slice, dim)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None,
    *,
    valid_kv_len: int | None = None,
    inner: dist.ProcessGroup | None = None,
    overlap: bool = True,
    scale: float | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Ulysses attention (USP when `inner` is given) of this rank's sequence slice.

    `q`, `k`, `v` are `[batch, seq_local, heads, head_dim]` with the same shape on every rank;
    `heads` must divide by the size of `group`. Without `inner`, rank `j` of `group` holds
    sequence slice `j`. With an `inner` ring group the layout is ring-major: the rank with
    ring index `i` and Ulysses index `j` holds slice `i * ulysses_degree + j`, and each
    Ulysses group's ranks share the ring index. `valid_kv_len` and `overlap` as in
    `ring_attention`. Returns this rank's slice of the output, like `q`.
    """
    _check_qkv(q, k, v)
    if q.shape != k.shape:
        raise ValueError(f"ulysses_attention needs q and k of the same shape; got {tuple(q.shape)} and {tuple(k.shape)}")
    degree, _ = group_size_and_rank(group)  # fails for a process outside the group
    heads = q.shape[2]
    if heads % degree:
        valid = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"{heads} heads do not split over a Ulysses degree of {degree}; valid degrees: {valid}")
    ring_degree = 1 if inner is None else dist.get_world_size(inner)
    gathered_len = degree * q.shape[1]
    valid_len = _check_valid_len(valid_kv_len, ring_degree * gathered_len)
    if degree == 1:
        q_heads, k_heads, v_heads = q, k, v
    else:
        q_heads, k_heads, v_heads = _sequence_to_heads(torch.stack((q, k, v)), group, degree)
    if inner is None:
        out = attention(q_heads, k_heads, v_heads, key_padding=gathered_len - valid_len, scale=scale, backend=backend)
    else:
        out = ring_attention(
            q_heads, k_heads, v_heads, inner, valid_kv_len=valid_len, overlap=overlap, scale=scale, backend=backend
        )
    return out if degree == 1 else _heads_to_sequence(out, group, degree)
