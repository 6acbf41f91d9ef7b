"""`wanmesh bench attention`: context-parallel attention kernels timed side by side in one run;
runs in the CLI process and the ranks it spawns.

For each degree a local world is spawned (gloo on CPU, NCCL with one GPU per rank on CUDA).
At each sequence length it times ring attention with overlapped transfers, the same ring
with transfers after each block, gathering all keys/values then attending once, Ulysses
(when the heads divide by the degree) and PyTorch's own `context_parallel` (where it runs).
It also counts the bytes each rank sends (`CollectiveCounter`) against the analytic count,
prints a table and writes a plot.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.attention import attention, ring_attention, ulysses_attention
from ..distributed.collectives import CollectiveCounter
from ..distributed.spawn import slowest_rank_median_s
from .common import int_list, measured_runs, mib, rank_device, run_world, write_rank_result

METHODS = ("ring_overlap", "ring_serial", "allgather", "ulysses", "torch_cp")
_DEFAULTS = {
    "cpu": {"seq_lens": "512,1024,2048", "heads": 4, "head_dim": 64, "dtype": "float32"},
    "cuda": {"seq_lens": "4096,16384,32760", "heads": 12, "head_dim": 128, "dtype": "bfloat16"},
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    parser.add_argument("--degrees", default="2,4", help="comma-separated context-parallel degrees (default 2,4)")
    parser.add_argument("--seq-lens", help="comma-separated global token counts (default: 512,1024,2048 on CPU, "
                        "4096,16384,32760 on CUDA)")
    parser.add_argument("--heads", type=int, help="attention heads (default 4 on CPU, 12 on CUDA)")
    parser.add_argument("--head-dim", type=int, help="head dimension (default 64 on CPU, 128 on CUDA)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(_DTYPES), help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all; torch_cp's first "
                        "call is slow to set up)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median is reported)")
    parser.add_argument("--plot", type=Path, default=Path("wanmesh_bench_attention.png"), help="PNG to write")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")


def _resolve(args: argparse.Namespace) -> dict:
    """Validated settings from the parsed arguments, before any process starts."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    defaults = _DEFAULTS[device]
    settings = {
        "device": device,
        "degrees": int_list(args.degrees, "--degrees"),
        "seq_lens": int_list(args.seq_lens or defaults["seq_lens"], "--seq-lens"),
        "heads": args.heads or defaults["heads"],
        "head_dim": args.head_dim or defaults["head_dim"],
        "batch": args.batch,
        "dtype": args.dtype or defaults["dtype"],
        "repeats": args.repeats,
        "methods": [name.strip() for name in args.methods.split(",") if name.strip()],
    }
    unknown = sorted(set(settings["methods"]) - set(METHODS))
    if unknown or not settings["methods"]:
        raise ValueError(f"--methods {args.methods!r} is not a subset of {','.join(METHODS)}")
    if min(settings["degrees"]) < 2:
        raise ValueError(f"--degrees must all be at least 2; got {settings['degrees']}")
    if min(settings["seq_lens"]) < max(settings["degrees"]):
        raise ValueError(f"--seq-lens must be at least the largest degree ({max(settings['degrees'])})")
    if min(settings["heads"], settings["head_dim"], settings["batch"], settings["repeats"]) < 1:
        raise ValueError("--heads, --head-dim, --batch and --repeats must be positive")
    if device == "cuda":
        available = torch.cuda.device_count()
        too_many = [d for d in settings["degrees"] if d > available]
        if too_many:
            raise ValueError(f"degrees {too_many} need one GPU per rank; {available} visible (valid: 2..{available})")
    return settings


# ------------------------------------------------------------------ inside a rank


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median over repeats of the slowest rank's wall time, in milliseconds."""
    return slowest_rank_median_s(fn, device, repeats, warmups=2) * 1e3


def _sent_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes this rank sends during one call, largest over ranks."""
    with CollectiveCounter() as counter:
        fn()
    sent = torch.tensor([counter.total_sent], dtype=torch.int64, device=device)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    return int(sent.item())


def _allgather_attention(q, k, v, valid_len: int) -> torch.Tensor:
    world = dist.get_world_size()
    local_kv = torch.stack((k, v))
    gathered = local_kv.new_empty((world * 2, *local_kv.shape[1:]))  # rank-major along dim 0
    # all_gather_single supersedes all_gather_into_tensor in recent PyTorch.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into(gathered, local_kv)
    full = gathered.unflatten(0, (world, 2)).permute(1, 2, 0, 3, 4, 5).flatten(2, 3)  # [2, B, world * s, H, D]
    return attention(q, full[0], full[1], key_padding=full.shape[2] - valid_len)


def _torch_cp_runner(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """PyTorch's context_parallel over replicated full q/k/v; returns (enter, call, exit) or raises."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    generator = torch.Generator(device=device).manual_seed(0)
    buffers = [torch.randn(shape, generator=generator, dtype=dtype, device=device).transpose(1, 2).contiguous()
               for _ in range(3)]
    context = context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2, 2, 2], no_restore_buffers=set(buffers))
    return context, lambda: F.scaled_dot_product_attention(*buffers)


def _bench_torch_cp(settings: dict, padded_len: int, dtype, device, analytic: int) -> dict:
    shape = (settings["batch"], padded_len, settings["heads"], settings["head_dim"])
    try:
        context, call = _torch_cp_runner(shape, dtype, device)
        with context:
            milliseconds = _timed(call, device, settings["repeats"])
        return {"time_ms": milliseconds, "sent_bytes": None, "analytic_bytes": analytic,
                "note": "unmasked padded length; traffic not counted (functional collectives)"}
    except Exception as error:  # noqa: BLE001 - any failure means "does not run here", reported in the table
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:120]
        return {"time_ms": None, "sent_bytes": None, "analytic_bytes": analytic, "note": f"does not run: {reason}"}


def _bench_point(settings: dict, seq_len: int, device: torch.device) -> list[dict]:
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = _DTYPES[settings["dtype"]]
    local_len = -(-seq_len // world)
    shape = (settings["batch"], local_len, settings["heads"], settings["head_dim"])
    generator = torch.Generator(device=device).manual_seed(rank)
    q, k, v = (torch.randn(shape, generator=generator, dtype=dtype, device=device) for _ in range(3))
    block_bytes = q.numel() * q.element_size()
    kv_ring_bytes = (world - 1) * 2 * block_bytes
    methods: dict[str, tuple[Callable[[], object], int]] = {
        "ring_overlap": (lambda: ring_attention(q, k, v, None, valid_kv_len=seq_len, overlap=True), kv_ring_bytes),
        "ring_serial": (lambda: ring_attention(q, k, v, None, valid_kv_len=seq_len, overlap=False), kv_ring_bytes),
        "allgather": (lambda: _allgather_attention(q, k, v, seq_len), kv_ring_bytes),
    }
    if settings["heads"] % world == 0:
        ulysses_bytes = 4 * (world - 1) * block_bytes // world
        methods["ulysses"] = (lambda: ulysses_attention(q, k, v, None, valid_kv_len=seq_len), ulysses_bytes)
    rows = []
    for name, (fn, analytic) in methods.items():
        if name not in settings["methods"]:
            continue
        milliseconds = _timed(fn, device, settings["repeats"])
        rows.append({"method": name, "time_ms": milliseconds, "sent_bytes": _sent_bytes(fn, device),
                     "analytic_bytes": analytic, "note": ""})
    if "torch_cp" in settings["methods"]:
        torch_cp = _bench_torch_cp(settings, local_len * world, dtype, device, kv_ring_bytes)
        rows.append({"method": "torch_cp", **torch_cp})
    return [{"degree": world, "seq_len": seq_len, **row} for row in rows]


def _rank_main(rank: int, world: int, settings: dict, result_folder: str) -> None:
    device = rank_device(settings, rank)
    rows = [row for seq_len in settings["seq_lens"] for row in _bench_point(settings, seq_len, device)]
    if rank == 0:
        write_rank_result(result_folder, rank, rows)


# ------------------------------------------------------------------ driver


def _run_world(degree: int, settings: dict) -> list[dict]:
    (rows,) = run_world(_rank_main, degree, settings)
    return rows


def format_table(rows: list[dict]) -> str:
    header = f"{'degree':>6} {'seq':>7} {'method':<13} {'ms':>10} {'MiB sent/rank':>14} {'analytic MiB':>13}  note"
    lines = [header, "-" * len(header)]
    for row in rows:
        time_text = "-" if row["time_ms"] is None else f"{row['time_ms']:.2f}"
        lines.append(
            f"{row['degree']:>6} {row['seq_len']:>7} {row['method']:<13} {time_text:>10} "
            f"{mib(row['sent_bytes'], 3):>14} {mib(row['analytic_bytes'], 3):>13}  {row['note']}"
        )
    return "\n".join(lines)


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (time_axes, bytes_axes) = plt.subplots(1, 2, figsize=(13, 5))
    for degree in sorted({row["degree"] for row in rows}):
        for method in METHODS:
            points = [(r["seq_len"], r["time_ms"]) for r in rows
                      if r["degree"] == degree and r["method"] == method and r["time_ms"] is not None]
            if points:
                time_axes.plot(*zip(*points), marker="o", label=f"{method} x{degree}")
    time_axes.set(xscale="log", yscale="log", xlabel="global sequence length (tokens)", ylabel="time (ms)",
                  title="attention time (slowest rank, median)")
    time_axes.legend(fontsize=7)
    counted = [r for r in rows if r["sent_bytes"] is not None]
    analytic = [r["analytic_bytes"] / 2**20 for r in counted]
    bytes_axes.scatter(analytic, [r["sent_bytes"] / 2**20 for r in counted], marker="x")
    if analytic:
        limit = max(analytic) * 1.05
        bytes_axes.plot([0, limit], [0, limit], linestyle="--", linewidth=1, label="measured = analytic")
        bytes_axes.legend(fontsize=7)
    bytes_axes.set(xlabel="analytic MiB sent per rank", ylabel="measured MiB sent per rank",
                   title="communication volume per rank")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run(args: argparse.Namespace) -> int:
    settings = _resolve(args)
    run = measured_runs(len(settings["degrees"]))  # a world per degree
    rows = []
    for degree in settings["degrees"]:
        run(f"degree {degree}")
        rows += _run_world(degree, settings)
    title = (f"{settings['device']} {settings['dtype']}, batch {settings['batch']}, "
             f"{settings['heads']} heads x {settings['head_dim']}")
    print(f"wanmesh bench attention: {title}")
    print(format_table(rows))
    write_plot(rows, args.plot, title)
    print(f"plot written to {args.plot}")
    if args.json:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wanmesh bench attention", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as error:
        parser.exit(2, f"wanmesh bench attention: error: {error}\n")


if __name__ == "__main__":
    raise SystemExit(main())
