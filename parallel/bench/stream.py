"""`wanmesh bench stream`: causal streaming speed - first-chunk latency, time per chunk, generated frames per
second and KV-cache memory per rank, for one rank and for Ulysses sequence parallel (fused all-to-all against
the three-gather baseline of the same layout); runs in the CLI process and the ranks it spawns.

Every row streams a whole video with ``sampling/stream.py``'s ``sample_stream`` on a random-weight Wan
transformer (speed does not depend on the weights). Each world runs in fresh processes; inside the SP world the
fused and the gather variants run in turn (interleaved, so drifting machine load hits both alike) after one
warm-up run each. The table gives the median over ``--repeats`` runs with the fastest and slowest run; times
are the slowest rank's. On CPU (gloo) collectives are slow and all-to-all is emulated, so the exchanged bytes
and collective calls per chunk are shown beside the times; judge speed on GPUs.

Each world also streams the video with a prompt switch before its middle chunk, interleaved with the fused runs:
the switch's cost is how much longer that chunk took than in the run without it (median over the paired runs),
given in seconds and in chunks' time, with the number of earlier chunks the switch re-encoded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import latent_shape, stream_chunks
from .common import check_repeats, int_list, mib, rank_device, run_world, write_rank_result

ROWS = (("world 1", 1, True), ("SP fused all-to-all", 2, True), ("SP three gathers", 2, False))


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Options of `wanmesh bench stream`."""
    parser.add_argument("--width", type=int, default=256, help="video width (multiple of 8)")
    parser.add_argument("--height", type=int, default=256, help="video height (multiple of 8)")
    parser.add_argument("--frames", type=int, default=33, help="video frames (4k+1)")
    parser.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk")
    parser.add_argument("--sp", default="2", help="comma list of sequence-parallel (Ulysses) degrees to compare")
    parser.add_argument("--heads", type=int, default=4, help="attention heads of the random transformer")
    parser.add_argument("--head-dim", type=int, default=32, help="head width (Wan 2.1 uses 128)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (Wan 2.1 1.3B: 30)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda runs rank r on cuda:r (NCCL)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (median, min and max are shown)")
    parser.add_argument("--plot", type=Path, default=Path("wanmesh_bench_stream.png"), help="PNG to write")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON")
    return parser


def _model(settings: dict, device: torch.device):
    from diffusers import WanTransformer3DModel

    from ..tiny.models import TINY_TRANSFORMER

    dim = settings["heads"] * settings["head_dim"]
    config = dict(TINY_TRANSFORMER, num_attention_heads=settings["heads"], attention_head_dim=settings["head_dim"],
                  num_layers=settings["layers"], ffn_dim=4 * dim)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if settings["dtype"] == "bf16" else torch.float32
    model = WanTransformer3DModel(**config).to(device=device).eval()
    return model.to(dtype=dtype) if dtype != torch.float32 else model


def _plan(world: int, rank: int, device: torch.device):
    """The ParallelContext of a world that is all Ulysses ranks (None for one rank)."""
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    from ..config import MESH_DIMS, ParallelConfig, rank_coordinates
    from ..distributed.mesh import ParallelContext

    config = ParallelConfig(world=world, ulysses=world, devices=device.type)
    mesh = init_device_mesh(device.type, config.mesh_shape, mesh_dim_names=MESH_DIMS)
    return ParallelContext(config=config, rank=rank, device=device, mesh=mesh, coords=rank_coordinates(config, rank))


def _one_run(model, inputs: dict, plan, fused: bool, switches: dict | None = None) -> dict:
    """One streamed video: seconds from the start to each finished chunk, this rank's largest KV cache, and the
    chunks each prompt switch re-encoded."""
    from ..sampling.stream import sample_stream

    stats: dict = {}
    if dist.is_initialized():
        dist.barrier()
    began = time.perf_counter()
    sample_stream(model, plan=plan, fused_all_to_all=fused, stats=stats, prompt_switches=switches, **inputs)
    return {"arrivals": stats["chunk_seconds"], "total": time.perf_counter() - began, "cache_bytes": stats["cache_bytes"],
            "recached": stats.get("recached_chunks", {})}


def switch_chunk(settings: dict) -> int:
    """The chunk before which the switched runs change the prompt: the middle one (at least chunk 1)."""
    count = len(stream_chunks(latent_shape(settings["width"], settings["height"], settings["frames"])[2],
                              settings["chunk"]))
    return max(1, count // 2)


def _slowest(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over the ranks (the slowest rank decides when a chunk is ready)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


def rank_main(rank: int, world: int, settings: dict, folder: str) -> None:
    from ..sampling import stream as stream_module

    device = rank_device(settings, rank)
    model = _model(settings, device)
    plan = _plan(world, rank, device)
    shape = latent_shape(settings["width"], settings["height"], settings["frames"])
    text = torch.randn(1, 32, model.config.text_dim, generator=torch.Generator().manual_seed(1))
    inputs = dict(positive=text.to(device=device, dtype=next(model.parameters()).dtype), negative=None,
                  latent_shape=shape, seed=0, sigmas=stream_module.stream_sigmas(settings["steps"], 5.0),
                  chunk=settings["chunk"])
    other = torch.randn(text.shape, generator=torch.Generator().manual_seed(2))
    switches = {switch_chunk(settings): other.to(device=inputs["positive"].device, dtype=inputs["positive"].dtype)}
    variants = [str(fused) for name, size, fused in ROWS if (size == 1) == (world == 1)] + ["switch"]
    samples: dict[str, list[list[float]]] = {variant: [] for variant in variants}
    peaks: dict[str, int] = {}
    recached: dict = {}
    for repeat in range(settings["repeats"] + 1):  # the first round is the warm-up
        for variant in variants:
            switched = variant == "switch"
            run = _one_run(model, inputs, plan, variant != "False", switches if switched else None)
            peaks[variant] = run["cache_bytes"]
            recached = run["recached"] if switched else recached
            if repeat:
                samples[variant].append(_slowest(run["arrivals"] + [run["total"]], device))
    if rank == 0:
        result = {variant: {"runs": runs, "cache_bytes": peaks[variant]} for variant, runs in samples.items()}
        result["switch"]["recached"] = {str(chunk): count for chunk, count in recached.items()}
        write_rank_result(folder, rank, result)


def switch_cost(result: dict, settings: dict) -> dict:
    """The prompt switch's extra time: its chunk's time in each switched run less that in the paired fused run
    without it; median, min and max in seconds, and the median in chunks' time."""
    chunk = switch_chunk(settings)
    extra = [(switched[chunk] - switched[chunk - 1]) - (plain[chunk] - plain[chunk - 1])
             for switched, plain in zip(result["switch"]["runs"], result["True"]["runs"])]
    chunk_times = [plain[chunk] - plain[chunk - 1] for plain in result["True"]["runs"]]
    median = statistics.median(extra)
    return {"chunk": chunk, "recached_chunks": int(result["switch"]["recached"][str(chunk)]),
            "extra_s": (median, min(extra), max(extra)), "chunks": median / statistics.median(chunk_times)}


def _row(name: str, world: int, fused: bool, result: dict, settings: dict) -> dict:
    """Median, min and max over the runs of one row; times in seconds."""
    chunks = stream_chunks(latent_shape(settings["width"], settings["height"], settings["frames"])[2], settings["chunk"])
    image_frames = settings["frames"]
    firsts = [run[0] for run in result["runs"]]
    per_chunk = [statistics.median([b - a for a, b in zip(run[:-2], run[1:-1])]) if len(chunks) > 1 else run[0]
                 for run in result["runs"]]
    fps = [image_frames / run[-1] for run in result["runs"]]
    row = {"name": name, "world": world, "fused": fused, "cache_bytes": result["cache_bytes"]}
    for key, values in (("first_chunk_s", firsts), ("chunk_s", per_chunk), ("fps", fps)):
        row[key] = (statistics.median(values), min(values), max(values))
    if world > 1:
        from ..distributed.causal_sp import exchange_bytes_per_chunk

        h, w = settings["height"] // 16, settings["width"] // 16
        element = 2 if settings["dtype"] == "bf16" else 4
        row["exchange"] = exchange_bytes_per_chunk(tokens=settings["chunk"] * h * w, heads=settings["heads"],
                                                   head_dim=settings["head_dim"], blocks=settings["layers"],
                                                   degree=world, element_bytes=element, fused=fused)
    return row


def format_table(rows: list[dict], settings: dict) -> str:
    lines = [f"causal streaming, {settings['width']}x{settings['height']}, {settings['frames']} frames, chunk "
             f"{settings['chunk']}, {settings['steps']} steps, {settings['layers']} blocks x {settings['heads']} heads "
             f"x {settings['head_dim']}, {settings['device']} (median [min..max] of {settings['repeats']} runs)",
             f"{'row':<24}{'first chunk s':>26}{'s per chunk':>26}{'frames/s':>26}{'cache MiB/rank':>16}"
             f"{'MiB sent/fwd':>14}{'calls/fwd':>11}"]
    for row in rows:
        cells = [f"{m:.3f} [{lo:.3f}..{hi:.3f}]" for m, lo, hi in (row["first_chunk_s"], row["chunk_s"], row["fps"])]
        exchange = row.get("exchange")
        sent = mib(exchange["bytes"]) if exchange else "-"
        calls = str(exchange["calls"]) if exchange else "-"
        lines.append(f"{row['name']:<24}{cells[0]:>26}{cells[1]:>26}{cells[2]:>26}{mib(row['cache_bytes']):>16}"
                     f"{sent:>14}{calls:>11}")
    for row in rows:
        cost = row.get("switch")
        if cost is not None:
            lines.append(f"{row['name']}: a prompt switch before chunk {cost['chunk']} re-encodes "
                         f"{cost['recached_chunks']} earlier chunk(s) and adds {cost['extra_s'][0]:.3f} s "
                         f"[{cost['extra_s'][1]:.3f}..{cost['extra_s'][2]:.3f}] to that chunk: "
                         f"{cost['chunks']:.2f} chunks' time")
    for degree in sorted({row["world"] for row in rows if row["world"] > 1}):
        fused = next(r for r in rows if r["world"] == degree and r["fused"])
        gather = next(r for r in rows if r["world"] == degree and not r["fused"])
        lines.append(f"SP {degree}: fused all-to-all / three gathers, end to end: "
                     f"{fused['fps'][0] / gather['fps'][0]:.3f}x the frames per second")
    return "\n".join(lines)


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    names = [row["name"] for row in rows]
    for ax, (key, label) in zip(axes[:3], (("first_chunk_s", "first-chunk latency (s)"),
                                           ("chunk_s", "time per chunk (s)"), ("fps", "generated frames / s"))):
        medians = [row[key][0] for row in rows]
        errors = [[row[key][0] - row[key][1] for row in rows], [row[key][2] - row[key][0] for row in rows]]
        ax.bar(names, medians, yerr=errors, capsize=4)
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
    axes[3].bar(names, [row["cache_bytes"] / 2**20 for row in rows])
    axes[3].set_title("KV cache per rank (MiB)")
    axes[3].tick_params(axis="x", labelrotation=20)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark, print the table, write the plot, return the rows."""
    from ..config import check_stream_options

    shape = latent_shape(args.width, args.height, args.frames)
    check_stream_options(shape[2], args.chunk, None, 0)
    degrees = int_list(args.sp, "--sp")
    check_repeats(args.repeats)
    settings = {k: v for k, v in vars(args).items() if k not in ("plot", "json")}
    rows = []
    for world in [1, *degrees]:
        result = run_world(rank_main, world, settings)[0]
        for name, size, fused in ROWS:
            if (size == 1) == (world == 1):
                label = name.replace("SP", f"SP {world}") if world > 1 else name
                rows.append(_row(label, world, fused, result[str(fused)], settings))
                if fused:
                    rows[-1]["switch"] = switch_cost(result, settings)
    table = format_table(rows, settings)
    print(table)
    write_plot(rows, args.plot, table.splitlines()[0])
    print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    return rows
