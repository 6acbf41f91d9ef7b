"""`wanmesh bench families`: the step time of the Wan variants with added inputs or modules (Wan 2.2 Fun Control
A14B, Wan 2.1 Fun Camera, Wan 2.2 Animate) against T2V at the same size, beside the FLOPs each one's transformer
call does; runs in the CLI process and its worker pools.

The four transformers share the preset's width, depth and text width (``tiny/families.py``, written once into
``--models`` or the cache). Every family samples ``--steps`` euler steps as ComfyUI's samplers drive the WanMesh
MODEL, which runs them all: one ``ModelForward`` per step with the conditional and unconditional rows together
(cfg), the loop here. The inputs, random with a seed and of the shapes the native nodes make:

* Fun Control: a control video and a reference image through the command line's ``--control-video`` conditioning
  (``cli/image_inputs.py``, VAE-encoded on the pool) and the workers' own image-channel and reference code.
* Fun Camera: the command line's ``--camera-motion`` embedding (``camera_motion.py``), no start image (empty image
  channels), no CLIP vision tokens, as ``wanmesh generate`` runs it.
* Animate (no command-line inputs): the model inputs built here as WanAnimateToVideo shapes them: the character
  image's latent frame before the video's (one latent frame more), image channels and mask, pose latents of the
  video's frames, a face video of 512x512 frames (the size the released motion encoder reads, kept) with the
  unconditional row all -1 as native, CLIP vision tokens. The ranks encode a face video once and reuse its tokens
  while it comes again, so each timed run gets a face video of its own and pays the encoders once, as a new video
  does.

Per family and layout (``--layouts``: one pool each): the median seconds per step over ``--repeats`` interleaved
runs after a one-step warm-up, the fastest and slowest, the ranks' CPU seconds per step, and the ratio to T2V (the
median of the per-round ratios). The FLOPs of the transformer call are counted by ``torch.utils.flop_counter`` on
one call in this process with the same inputs (Animate: its first call, with the encoders, and a later one; per
step the encoders' share over the run's steps); the added modules' share is what the family adds to T2V's count.
The target: a family's time ratio at most its FLOP ratio (its added modules cost at most their share of the FLOPs).
Prints a table (with the load average), writes JSON and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from ..tiny.families import FAMILIES, FAMILY_NAMES
from .cache import LAYOUTS
from .common import check_repeats, cpu_seconds, measured_runs

TEXT_TOKENS = 512  # umT5's padded prompt length, as ComfyUI hands it to the model
CAMERA_MOTION = "zoom-in"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=["tiny", "medium"],
                        help="the size of the transformers (the `make-tiny` presets'; medium is the reference size)")
    parser.add_argument("--models", type=Path, help="a tree holding the families' files (written there when missing; "
                        "default: the cache's bench-families folder)")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)} "
                        "(T2V is always measured)")
    parser.add_argument("--layouts", default="world1", help=f"comma list of {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=4, help="euler steps per timed run")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--shift", type=float, default=5.0)
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: the pool's default)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per family (after a one-step warm-up)")
    parser.add_argument("--json", type=Path, default=Path("wanmesh_bench_families.json"))
    parser.add_argument("--plot", type=Path, default=Path("wanmesh_bench_families.png"))


# -- the families' model calls ----------------------------------------------------------------------------------------


@dataclass
class FamilyCall:
    """What one family's model calls take beside the sampled latent: its image channels (after the latent's 16),
    the text, the ModelForward fields of its inputs; Animate's face video is drawn anew for each run."""

    frames: int  # latent frames of the model input (Animate: one more, the character image's)
    size: tuple[int, int]  # the latent's height and width
    context: torch.Tensor  # [2, tokens, text_dim]: conditional and unconditional rows
    concat: torch.Tensor | None = None  # [2, C, frames, h, w]
    fields: dict = field(default_factory=dict)
    face_frames: int = 0  # Animate: the face video's frames (0: none)

    def face(self, seed: int) -> dict:
        """The face video of one run (WanAnimateToVideo's rows: the video in [-1, 1], the unconditional all -1)."""
        if not self.face_frames:
            return {}
        from ..config import ANIMATE_FACE_SIZE

        size = ANIMATE_FACE_SIZE
        video = torch.rand(1, 3, self.face_frames, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1
        return {"face_pixels": torch.cat([video, torch.full_like(video, -1.0)])}

    def noise(self) -> torch.Tensor:
        """The latent a run starts from (one row; seeded)."""
        from ..config import LATENT_CHANNELS

        return torch.randn(1, LATENT_CHANNELS, self.frames, *self.size, generator=torch.Generator().manual_seed(1))

    def request(self, handle: str, x: torch.Tensor, sigma: float, face: dict):
        from ..protocol import ModelForward

        rows = torch.cat([x, x])
        latent = rows if self.concat is None else torch.cat([rows, self.concat], dim=1)
        return ModelForward(handle=handle, latent=latent, timestep=torch.full((2,), sigma * 1000.0),
                            context=self.context, **self.fields, **face)


def build_call(family: str, model, runner, vae: str, args) -> FamilyCall:
    """A family's inputs at the run's size (``model``: its transformer, for its config)."""
    from ..config import CLIP_VISION_TOKENS, CLIP_VISION_WIDTH, LATENT_CHANNELS, latent_shape

    shape = latent_shape(args.width, args.height, args.frames, 2)
    generator = torch.Generator().manual_seed(0)
    text = torch.randn(2, TEXT_TOKENS, model.config.text_dim, generator=generator)
    call = FamilyCall(shape[2], tuple(shape[3:]), text)
    if family == "fun22_control":
        return _fun_control_call(call, model, runner, vae, args, shape, generator)
    if family == "fun_camera":
        from ..camera_motion import camera_embedding
        from ..sampling.forward import image_concat_input
        from ..sampling.guidance import IMAGE_CONCAT

        concat = image_concat_input(model, None, range(2), shape, torch.float32, "cpu")[IMAGE_CONCAT]
        camera = camera_embedding(CAMERA_MOTION, args.width, args.height, args.frames)
        return replace(call, concat=concat, fields={"camera_conditions": camera})
    if family == "animate":
        from ..image_to_video import MASK_CHANNELS
        from ..sampling.loop import image_channels

        frames = shape[2] + 1  # the character image's latent frame first
        h, w = call.size
        image = torch.randn(1, LATENT_CHANNELS, frames, h, w, generator=generator)
        mask = torch.ones(1, MASK_CHANNELS, frames, h, w)
        mask[:, :, 0] = 0.0  # the character image's frame is given
        concat = image_channels(model, image, mask, 0, (2, LATENT_CHANNELS, frames, h, w))
        fields = {"pose_latents": torch.randn(1, LATENT_CHANNELS, shape[2], h, w, generator=generator),
                  "clip_fea": torch.randn(1, CLIP_VISION_TOKENS, CLIP_VISION_WIDTH, generator=generator)}
        return replace(call, frames=frames, concat=concat, fields=fields, face_frames=args.frames)
    return call


def _fun_control_call(call: FamilyCall, model, runner, vae: str, args, shape: tuple, generator) -> FamilyCall:
    """Wan22FunControlToVideo's inputs as ``wanmesh generate --control-video ... --image ...`` builds them: a
    control video and a reference image encoded on the pool, then the image channels and the reference as the
    workers make them of a sampling request."""
    from ..cli.image_inputs import ImageInputs
    from ..networks.reference import REFERENCE_KEYWORD
    from ..sampling.loop import image_channels, model_latent_stats, reference_input

    control = torch.rand(args.frames, args.height, args.width, 3, generator=generator)
    reference = torch.rand(1, args.height, args.width, 3, generator=generator)
    inputs = ImageInputs("fun_control", reference, None, None, control, model.config.in_channels)
    sizes = SimpleNamespace(width=args.width, height=args.height, frames=args.frames, vae_tile=None, vae_overlap=None)
    given = inputs.sample_fields(runner, vae, sizes)
    concat = image_channels(model, given["image_latents"], given["image_mask"], given["image_mask_index"], shape)
    mean, std = model_latent_stats(model)
    normalised = reference_input(given["reference_latent"], mean, std, range(2), 2, torch.float32, "cpu")
    return replace(call, concat=concat, fields={"reference_latent": normalised[REFERENCE_KEYWORD]})


# -- counting FLOPs ---------------------------------------------------------------------------------------------------


def _cpu_flash_attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query, key, value)


def call_flops(model, request) -> tuple[int, dict[str, int]]:
    """The FLOPs of one model call as the workers run it (``sampling/forward.forward_rows``, every row), in total and
    per top-level module. torch's counter has formulas for the CUDA attention kernels but not for the CPU's flash
    attention, which would count as zero here: its formula is the same (two matmuls per head), given for it."""
    from torch.utils.flop_counter import FlopCounterMode

    from ..sampling.forward import forward_rows

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_attention_flops}
    with torch.no_grad(), FlopCounterMode(display=False, depth=4, custom_mapping=mapping) as counter:
        forward_rows(model, request, range(request.latent.shape[0]), torch.float32, torch.device("cpu"))
    return counter.get_total_flops(), _top_level(counter.get_flop_counts(), type(model).__name__)


def _top_level(counts: dict[str, dict], root: str) -> dict[str, int]:
    """The FLOPs per top-level module of the model (``blocks``, ``motion_encoder``, ...): the counter's modules that
    ran within no other counted module (containers such as ``blocks`` are never called themselves), summed per
    first name."""
    names = {name.removeprefix(f"{root}."): sum(ops.values()) for name, ops in counts.items()
             if name.startswith(f"{root}.")}
    totals: dict[str, int] = {}
    for name, flops in names.items():
        parts = name.split(".")
        if not any(".".join(parts[:end]) in names for end in range(1, len(parts))):
            totals[parts[0]] = totals.get(parts[0], 0) + flops
    return totals


def family_flops(path: str, family: str, runner, vae: str, args) -> tuple[FamilyCall, dict]:
    """A family's call inputs and its FLOPs: the first call's (Animate: with the face encoders), a later call's, and
    the mean per step over ``args.steps``."""
    from ..weights.loaders import load_transformer

    model = load_transformer(path)
    call = build_call(family, model, runner, vae, args)
    request = call.request("", call.noise(), 1.0, call.face(0))
    first, modules = call_flops(model, request)
    later = call_flops(model, request)[0] if call.face_frames else first  # the face tokens reused
    per_step = (first + (args.steps - 1) * later) / args.steps
    return call, {"first_call": first, "later_call": later, "per_step": per_step, "by_module": modules}


# -- timing -----------------------------------------------------------------------------------------------------------


def sample(runner, handle: str, call: FamilyCall, sigmas: torch.Tensor, cfg: float, face: dict) -> torch.Tensor:
    """Euler steps over ``sigmas``, one guided ModelForward each (the conditional and unconditional rows together)."""
    x = call.noise()
    for index in range(len(sigmas) - 1):
        prediction = runner.forward(call.request(handle, x, float(sigmas[index]), face))
        conditional, unconditional = prediction[:1], prediction[1:]
        x = x + (sigmas[index + 1] - sigmas[index]) * (unconditional + cfg * (conditional - unconditional))
    return x


def time_layout(runner, handles: dict[str, str], calls: dict[str, FamilyCall], args, layout: str, run) -> dict:
    """Per family: seconds per step of each timed run (wall and the ranks' CPU), the runs interleaved across the
    families after a one-step warm-up each."""
    from ..sampling.schedules import schedule

    sigmas = schedule("simple", args.steps, args.shift)
    for family, call in calls.items():
        run(f"{layout}, {FAMILY_NAMES[family]}, warm-up (1 step)")
        sample(runner, handles[family], call, sigmas[:2], args.cfg, call.face(0))
    wall: dict[str, list[float]] = {family: [] for family in calls}
    cpu: dict[str, list[float]] = {family: [] for family in calls}
    for repeat in range(args.repeats):
        for family, call in calls.items():
            face = call.face(repeat + 1)  # a new face video: the ranks encode it once, in this run
            run(f"{layout}, {FAMILY_NAMES[family]}, run {repeat + 1}/{args.repeats}")
            pids = runner.pool.pids()
            cpu_start, start = cpu_seconds(pids), time.perf_counter()
            sample(runner, handles[family], call, sigmas, args.cfg, face)
            wall[family].append((time.perf_counter() - start) / args.steps)
            cpu[family].append((cpu_seconds(pids) - cpu_start) / args.steps)
    return {"wall": wall, "cpu": cpu}


# -- rows, table, plot ------------------------------------------------------------------------------------------------


def layout_rows(layout: str, times: dict, flops: dict[str, dict]) -> list[dict]:
    """A row per family: its step times, their ratio to T2V's (the median of the per-round ratios, interleaved runs
    sharing the machine's load), the FLOPs per step and their ratio, and whether the time ratio is within it."""
    wall, cpu = times["wall"], times["cpu"]
    base_flops = flops["t2v"]["per_step"]
    rows = []
    for family in wall:
        ratios = [mine / t2v for mine, t2v in zip(wall[family], wall["t2v"])]
        cpu_ratios = [mine / t2v for mine, t2v in zip(cpu[family], cpu["t2v"]) if t2v > 0]
        counted = flops[family]
        flop_ratio = counted["per_step"] / base_flops
        row = {"layout": layout, "family": family, "name": FAMILY_NAMES[family],
               "step_s": statistics.median(wall[family]), "spread_s": [min(wall[family]), max(wall[family])],
               "runs_s": wall[family], "cpu_step_s": statistics.median(cpu[family]), "runs_cpu_s": cpu[family],
               "ratio_to_t2v": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)],
               "cpu_ratio_to_t2v": statistics.median(cpu_ratios) if cpu_ratios else None,
               "flops_per_step": counted["per_step"], "flops_first_call": counted["first_call"],
               "flops_later_call": counted["later_call"], "flops_by_module": counted["by_module"],
               "flop_ratio": flop_ratio, "added_flop_share": 1.0 - base_flops / counted["per_step"]}
        row["within_flop_ratio"] = None if family == "t2v" else row["ratio_to_t2v"] <= flop_ratio
        row["cpu_within_flop_ratio"] = (None if family == "t2v" or row["cpu_ratio_to_t2v"] is None
                                        else row["cpu_ratio_to_t2v"] <= flop_ratio)
        rows.append(row)
    return rows


def _yes(value) -> str:
    return "-" if value is None else "yes" if value else "NO"


TABLE = (("layout", "<9", lambda r: r["layout"]), ("family", "<20", lambda r: r["name"]),
         ("step s", ">7.3f", lambda r: r["step_s"]),
         ("spread", "<15", lambda r: "{:.3f}..{:.3f}".format(*r["spread_s"])),
         ("x T2V", ">6.3f", lambda r: r["ratio_to_t2v"]),
         ("CPU s", ">7.3f", lambda r: r["cpu_step_s"]),
         ("CPU x", ">6", lambda r: "-" if r["cpu_ratio_to_t2v"] is None else f"{r['cpu_ratio_to_t2v']:.3f}"),
         ("GFLOP/step", ">10.1f", lambda r: r["flops_per_step"] / 1e9),
         ("FLOP x", ">6.3f", lambda r: r["flop_ratio"]),
         ("added", ">6.1%", lambda r: r["added_flop_share"]),
         ("within", ">6", lambda r: _yes(r["within_flop_ratio"])),
         ("CPU within", ">10", lambda r: _yes(r["cpu_within_flop_ratio"])))  # (header, format, value)


def format_table(rows: list[dict]) -> str:
    header = " ".join(f"{name:{spec[0] if spec[0] in '<>' else '<'}{spec.lstrip('<>').split('.')[0]}}"
                      for name, spec, _ in TABLE)
    lines = [" ".join(f"{value(row):{spec}}" for _, spec, value in TABLE) for row in rows]
    return "\n".join([header, *lines])


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    """Per layout, each family's step-time ratio to T2V (bar, fastest to slowest round as the error bar) beside
    its FLOP ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    figure, axes = plt.subplots(1, len(layouts), figsize=(5 * len(layouts), 4.5), squeeze=False)
    for axis, layout in zip(axes[0], layouts):
        mine = [row for row in rows if row["layout"] == layout]
        places = range(len(mine))
        ratios = [row["ratio_to_t2v"] for row in mine]
        errors = [[r - row["ratio_spread"][0] for r, row in zip(ratios, mine)],
                  [row["ratio_spread"][1] - r for r, row in zip(ratios, mine)]]
        axis.bar([p - 0.2 for p in places], ratios, 0.4, yerr=errors, capsize=3, label="step time / T2V")
        axis.bar([p + 0.2 for p in places], [row["flop_ratio"] for row in mine], 0.4, label="FLOPs / T2V")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks(list(places), [row["name"].replace("Wan ", "") for row in mine], rotation=20, fontsize=8)
        axis.set(title=layout, ylabel="ratio to T2V")
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# -- the command ------------------------------------------------------------------------------------------------------


def _names(text: str, valid, flag: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in valid]
    if unknown or not names:
        raise ValueError(f"{flag}: {', '.join(unknown) or 'none given'}; valid: {', '.join(valid)}")
    return names


def check_arguments(args) -> tuple[list[str], list[str]]:
    """The layouts and families (T2V first), checked before any file is written or pool started."""
    from ..config import VAE_SPATIAL_FACTOR, WAN22_VAE_SPATIAL_FACTOR, check_video_size

    check_repeats(args.repeats)
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    layouts = _names(args.layouts, LAYOUTS, "--layouts")
    families = ["t2v", *(name for name in _names(args.families, FAMILIES, "--families") if name != "t2v")]
    # the camera adapter folds 16-pixel cells (as --camera-motion needs); the others the VAE's 8
    factor = WAN22_VAE_SPATIAL_FACTOR if "fun_camera" in families else VAE_SPATIAL_FACTOR
    check_video_size(args.width, args.height, args.frames, factor)
    return layouts, families


def run(args) -> list[dict]:
    from ..config import ParallelConfig, cache_root
    from ..driver.pool import WorkerPool
    from ..driver.runner import PoolRunner
    from ..tiny.families import ensure_family_files

    layouts, families = check_arguments(args)
    root = args.models or cache_root() / "bench-families"
    quiet = getattr(args, "quiet", False)
    paths = ensure_family_files(root, args.preset, tuple(families),
                                say=lambda line: quiet or print(f"bench families: {line}", file=sys.stderr, flush=True))
    if args.threads:
        os.environ["WANMESH_WORKER_THREADS"] = str(args.threads)
    load_before = os.getloadavg()
    calls, flops, rows, progress = {}, {}, [], None
    for layout in layouts:
        config = ParallelConfig(devices="cpu" if args.device == "cpu" else "auto", **LAYOUTS[layout])
        with WorkerPool(config, timeout_s=3600) as pool:
            runner = PoolRunner(pool, previews=False)
            if not calls:  # the inputs (Fun Control's encoded on this pool) and the FLOPs, once
                vae = runner.load_vae(str(paths["vae"]))
                for family in families:
                    calls[family], flops[family] = family_flops(str(paths[family]), family, runner, vae, args)
                progress = measured_runs(len(layouts) * len(families) * (args.repeats + 1))
            handles = {family: runner.load_model(str(paths[family])) for family in families}
            rows += layout_rows(layout, time_layout(runner, handles, calls, args, layout, progress), flops)
    title = (f"{args.preset} preset, {args.width}x{args.height}, {args.frames} frames, {args.steps} euler steps, "
             f"cfg {args.cfg}, {args.device}")
    load = {"before": load_before, "after": os.getloadavg()}
    print(f"wanmesh bench families: {title}; {args.repeats} interleaved runs per family, seconds per step (median, "
          f"fastest..slowest), load average before {' '.join(f'{v:.2f}' for v in load['before'])}, after "
          f"{' '.join(f'{v:.2f}' for v in load['after'])}")
    print(format_table(rows))
    written = {"title": title, "preset": args.preset, "steps": args.steps, "repeats": args.repeats,
               "size": [args.width, args.height, args.frames], "files": {f: str(paths[f]) for f in families},
               "load_average": load, "rows": rows}
    args.json.write_text(json.dumps(written, indent=2))
    write_plot(rows, args.plot, title)
    print(f"JSON written to {args.json}, plot to {args.plot}")
    return rows
