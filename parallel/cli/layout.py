"""`--layout auto` for `wanmesh generate` and `wanmesh stream`: the degrees chosen for the job by the cost model
(``auto_layout.py``, calibrated by ``calibration.py``), logged as a small table; runs in the CLI process."""

from __future__ import annotations

import sys

from ..config import ParallelConfig
from ..fields import add_flag


def add_layout_arguments(group, command: str) -> None:
    add_flag(group, "layout", command)
    add_flag(group, "reprobe", command)


def check_layout_arguments(args) -> None:
    """--layout auto picks every degree: a degree given as well is a mistake, refused before anything runs."""
    if args.layout != "auto":
        return
    from ..auto_layout import degrees_set

    given = degrees_set(args.tp, args.ulysses, args.ring, args.vae_patch, args.cfg_parallel)
    if given:
        flags = ", ".join("--" + entry.split("=")[0].replace("_", "-") for entry in given)
        raise ValueError(f"--layout auto chooses the degrees itself; leave out {flags}, or use --layout "
                         "manual (the default) to set them")


def auto_layout_config(args, model_path: str, config: ParallelConfig, *, streaming: bool) -> ParallelConfig:
    """``config`` with the degrees ``auto`` chose for this job (unchanged with --layout manual)."""
    if args.layout != "auto":
        return config
    from ..auto_layout import Job, explain
    from ..calibration import choose_layout

    job = Job(args.width, args.height, args.frames, steps=args.steps, guidance=args.guidance_scale != 1.0)
    ranked = choose_layout(config, model_path, job, streaming=streaming, reprobe=args.reprobe)
    print(explain(ranked, job), file=sys.stderr, flush=True)
    return ranked[0].layout.applied_to(config)
