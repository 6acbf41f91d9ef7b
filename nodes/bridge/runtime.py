"""Where node work runs, and the handles that travel between nodes (WANMESH_MODEL, WANMESH_VAE, ...)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...parallel import PoolRunner

if TYPE_CHECKING:
    from ...parallel.config import ParallelConfig


def default_runner() -> PoolRunner:
    """The runner of loaders with no pool connected: the live pool, else a one-rank pool (first GPU, or CPU)."""
    return PoolRunner.current_or_single()


MODEL_KINDS = ("model", "vae", "text_encoder")


@dataclass(frozen=True)
class ResidentModel:
    """A model resident in a runner; nodes pass this along instead of the model itself. ``handle`` is the pool's
    key for the loaded weights: sent back with every request, never taken apart; what a node needs to know of the
    model (its kind, its files) is in the typed fields."""

    runner: PoolRunner
    handle: str
    loras: tuple[tuple[str, float], ...] = ()  # (LoRA file, strength) in order, merged on the workers when sampling
    path: str | None = None  # the file it was loaded from (read by checks that need only its header)
    vace_module: str | None = None  # the VACE module merged onto a transformer
    kind: str = MODEL_KINDS[0]

    def model_files(self) -> list[str]:
        """The transformer file and its VACE module, whose headers LoRA and VACE checks read."""
        if self.kind != "model" or self.path is None:
            raise ValueError(f"this is a loaded {self.kind} (no transformer file known); a LoRA or a native MODEL needs "
                             "a Wan model from the WanMesh Model Loader")
        return [path for path in (self.path, self.vace_module) if path]


PREVIEW_MAX_RESOLUTION = 512  # what ComfyUI's own latent previews are limited to


def progress_reporter(total: int):
    """A progress(step, total, preview=None) callback driving ComfyUI's progress bar and its preview image,
    the way ComfyUI's own samplers show what is being made."""
    import comfy.utils

    bar = comfy.utils.ProgressBar(total)

    def report(step: int, steps: int, preview=None) -> None:
        if preview is None:
            bar.update_absolute(step, steps)
            return
        from PIL import Image

        bar.update_absolute(step, steps, ("JPEG", Image.fromarray(preview), PREVIEW_MAX_RESOLUTION))

    return report


def arrange_for_job(model: ResidentModel, latent, steps: int, cfg: float, *, streaming: bool = False) -> None:
    """With a Pool node on layout auto: the degrees the cost model picks for this job (video size from the latent),
    logged as a small table; the pool is restarted only when the choice changes."""
    from ...parallel.auto_layout import Job

    if auto_layout_of(model):
        arrange(model, Job.of_latent(latent.shape, steps=steps, batch=latent.shape[0], guidance=cfg != 1.0),
                streaming=streaming)


def auto_layout_of(model: ResidentModel) -> bool:
    """Whether ``model``'s pool came from a Pool node on layout auto (stand-in runners and models with no file
    have no layout to choose)."""
    return bool(getattr(model.runner, "auto_layout", False)) and model.path is not None


def arrange(model: ResidentModel, job, *, streaming: bool = False, caller: str = "") -> ParallelConfig:
    """Arrange ``model``'s pool on the layout the cost model ranks first for ``job``; the table goes to the log.
    Returns the arranged config."""
    from ...parallel.auto_layout import explain
    from ...parallel.calibration import choose_layout

    runner = model.runner
    ranked = choose_layout(runner.config, model.path, job, streaming=streaming, runner=runner)
    logging.getLogger("wanmesh").info("WanMesh %s%s", caller, explain(ranked, job))
    config = ranked[0].layout.applied_to(runner.config)
    runner.arrange(config)
    return config


def previews_enabled(runner: PoolRunner) -> bool:
    """Whether the sampler asks for per-step previews: the ``previews`` input of the WanMesh Pool node that made
    ``runner`` (on for loaders with no pool connected)."""
    return bool(getattr(runner, "previews", True))


def interrupted() -> bool:
    import comfy.model_management

    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    """Turn an engine cancel into ComfyUI's own interrupt exception."""
    import comfy.model_management

    comfy.model_management.throw_exception_if_processing_interrupted()
