"""The `wanmesh` command line: make-tiny, generate, stream and bench; runs in the CLI (driver) process.

It drives the same worker pool and runner the ComfyUI nodes use. Subcommands import what they need when run:
the parser (``parser.py``) and the quick checks of the values given (``plan.py``) load no torch, so `wanmesh
--help` and refusals of bad flags and values answer at once. Before any work ``plan.py`` says in one line what will
be done; ``progress.py`` then shows the phases and the steps (``--quiet``: neither).

Exit codes: 0 done, 2 bad input (one line on stderr, found before any worker starts where the check is static),
1 a runtime failure (a worker error, an OS error such as a full disk: one line), 130 interrupted (Ctrl-C).
`--debug` prints the traceback as well.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback

from .layout import check_layout_arguments
from .plan import model_defaults, quick_checks
from .progress import Progress, finished
from .parser import (BENCHMARKS, REAL_DEFAULTS, REAL_STREAM_DEFAULTS, TINY_DEFAULTS, TINY_STREAM_DEFAULTS,  # noqa: F401
                     add_model_file_arguments, add_pool_arguments, bench_named, build_parser, wants_image, wants_vace)


def _stream_cli():
    from . import stream

    return stream


def _bench_module(name: str):
    import importlib

    return importlib.import_module(f"{__package__.rpartition('.')[0]}.bench.{name}")


def resolve_model_files(args):
    """The run's model files (``plan.ModelFiles``): --models or the tiny set, each single-file flag replacing one."""
    from .plan import resolve_model_files as resolve

    return resolve(args)


def read_loras(lora_args: list[str], files: dict) -> list[tuple[str, float]]:
    """--lora FILE[:STRENGTH] values as (file, strength), each file's header checked against the model's."""
    from ..validation import check_lora_values
    from ..weights.lora_files import check_lora_for_model, parse_lora_arg

    loras = [parse_lora_arg(text) for text in lora_args]
    model_files = [path for path in (files["model"], files["vace_module"]) if path]
    for path, _ in loras:
        check_lora_for_model(path, model_files)
        check_lora_values(path, "--lora")
    return loras


EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(bench_options=bench_named(argv)).parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return _fail(args, EXIT_INTERRUPTED, "interrupted")
    except ValueError as error:  # bad input (checks in config.py / validation.py): one line
        return _fail(args, EXIT_BAD_INPUT, str(error))
    except Exception as error:  # noqa: BLE001 - worker errors, OS errors: one line, traceback with --debug
        return _fail(args, EXIT_FAILED, one_line(error))


def one_line(error: BaseException) -> str:
    """The cause in one line: a worker error's rank, type and message (its traceback stays out), an OS error's
    text with the file it concerns."""
    from ..errors import WorkerError

    if isinstance(error, WorkerError):
        where = f"rank {error.rank}" if error.rank is not None else "worker pool"
        return f"{where}: {error.error_type}: {error.message.strip().splitlines()[0] if error.message else ''}"
    if isinstance(error, OSError) and error.strerror:
        where = f": {error.filename}" if error.filename else ""
        return f"{type(error).__name__}: {error.strerror}{where}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _fail(args, code: int, message: str) -> int:
    Progress.close_all()
    if getattr(args, "debug", False):
        traceback.print_exc()
    print(f"wanmesh: error: {message}" if code != EXIT_INTERRUPTED else message, file=sys.stderr, flush=True)
    return code


def _run(args) -> int:
    if args.command in ("generate", "stream"):
        check_layout_arguments(args)
        quick_checks(args)  # the values given, before anything heavy loads
    if args.command == "make-tiny":
        return _make_tiny(args)
    if args.command == "generate":
        from .generate import generate
        from .image_inputs import ImageInputs
        from .vace_inputs import read_vace_inputs

        files = resolve_model_files(args)
        paths = files.paths
        paths["loras"] = read_loras(args.lora, paths)  # headers checked against the model before the pool starts
        vace = read_vace_inputs(args, paths)  # VACE files read and checked; sizes default to the video's
        defaults = model_defaults(args, paths["model"])
        image = ImageInputs.read(args, paths)  # the model's kind against the images given, images read
        generate(args, files, vace, image, defaults)
        return 0
    if args.command == "stream":
        stream = _stream_cli()
        provisional = copy.copy(args)  # every option, before model files are made or read (the sizes not given
        for key, value in (TINY_STREAM_DEFAULTS if args.model is None else REAL_STREAM_DEFAULTS).items():
            if getattr(provisional, key) is None:  # as a test model's or a Wan release's; the model says which)
                setattr(provisional, key, value)
        stream.check_stream_arguments(provisional)
        files = resolve_model_files(args)
        defaults = model_defaults(args, files.paths["model"], stream=True)
        stream.stream(args, files, defaults)
        return 0
    if args.command == "bench":
        return _bench(args)
    return 2


def _bench(args) -> int:
    """One benchmark with its phase line, a line per measured run (``bench/common.measured_runs``, switched on
    through the environment so that spawned ranks inherit it, and off again afterwards for a caller that goes on,
    such as a test calling ``main``) and the result line."""
    quiet = getattr(args, "quiet", False)
    progress_env = _bench_module("common").PROGRESS_ENV
    before = os.environ.get(progress_env)
    try:
        with Progress(quiet).phase(f"bench {args.bench}: {BENCHMARKS[args.bench][1]}"):
            module = _bench_module(BENCHMARKS[args.bench][0])
            if not quiet:
                os.environ[progress_env] = args.bench
            status = module.run(args)
    finally:
        if before is None:
            os.environ.pop(progress_env, None)
        else:
            os.environ[progress_env] = before
    if not quiet:
        finished(f"bench {args.bench} done")
    return status if isinstance(status, int) else 0  # some benchmarks return their rows


def _make_tiny(args) -> int:
    progress = Progress(args.quiet)
    with progress.phase(f"write the {args.preset} models to {args.directory}"):
        from ..tiny.models import make_models

        written = make_models(args.directory, args.preset,
                              lambda index, total, what: progress.say(f"  write {index}/{total}: {what}"))
    if args.native_vae22:
        from ..tiny.vae22 import write_native_vae22

        with progress.phase("write the release-width Wan 2.2 VAE (1.4 GB)"):
            written["vae22_native"] = write_native_vae22(args.directory)
    for name, path in written.items():
        print(f"{name:>14}: {path}")
    finished(f"wrote {len(written)} {args.preset} model files to {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
