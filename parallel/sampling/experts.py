"""Two experts and step ranges for one sampling run (Wan 2.2 A14B, chained samplers); runs in the workers.

Wan 2.2 A14B is two Wan 2.1-shaped transformers: a high-noise expert for the early, noisy steps and a
low-noise expert for the rest. The rule followed is the one of Wan 2.2's reference ``generate`` and of
diffusers' ``WanPipeline`` (``boundary_ratio``): a step whose scheduler timestep ``t`` (0..1000 scale) satisfies
``t >= boundary * 1000`` runs the high-noise expert with ``guidance_scale``, every other step the low-noise
expert with ``guidance_scale_low`` (the high-noise scale when unset). Boundary 0 therefore never switches;
boundary 1 switches before the first step whose timestep is below 1000 (every step of UniPC, whose first
timestep is 999; Euler's first timestep is exactly 1000, so that one step stays with the high-noise expert).

Step ranges follow ComfyUI's ``KSamplerAdvanced`` (start_at_step, end_at_step, add_noise, leftover noise):
the schedule is always the one of ``steps`` steps, a run covers ``start_step <= i < end_step`` of it and
returns the latent after ``end_step`` with its leftover noise. Two chained runs (the first ending at ``k``,
the second starting at ``k`` with ``add_noise=False``) equal one run for single-step samplers (Euler).
UniPC is a multistep solver: its history (earlier model outputs, the corrector's last sample) does not
travel in a latent, so a chained second run restarts it at first order, as chained ComfyUI samplers do; the
result is close to one run but not identical, and ``describe_expert_steps`` says so in the reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

NUM_TRAIN_TIMESTEPS = 1000
HIGH_NOISE, LOW_NOISE = "high-noise expert", "low-noise expert"
MULTISTEP_SAMPLERS = ("unipc", "wan_unipc", "uni_pc", "dpmpp_2m")  # samplers whose state spans steps (a chain restarts it)


def runs_high_noise_expert(timestep: float, boundary: float) -> bool:
    """The reference rule: timesteps at or above boundary x 1000 belong to the high-noise expert."""
    return float(timestep) >= boundary * NUM_TRAIN_TIMESTEPS


@dataclass(frozen=True)
class Expert:
    name: str
    model: Callable
    guidance_scale: float


@dataclass(frozen=True)
class Experts:
    """The model and guidance scale of each step; without a low-noise expert the one model runs every step."""

    high: Expert
    low: Expert | None
    boundary: float

    @classmethod
    def for_request(cls, model: Callable, low_model: Callable | None, request) -> "Experts":
        low = None
        if low_model is not None:
            scale = request.guidance_scale if request.guidance_scale_low is None else request.guidance_scale_low
            low = Expert(LOW_NOISE, low_model, scale)
        return cls(Expert(HIGH_NOISE, model, request.guidance_scale), low, request.boundary)

    def at(self, timestep) -> Expert:
        if self.low is None or runs_high_noise_expert(timestep, self.boundary):
            return self.high
        return self.low

    @property
    def needs_negative(self) -> bool:
        """Whether any step runs classifier-free guidance (a guidance scale of 1 is a single pass)."""
        return any(e.guidance_scale != 1.0 for e in (self.high, self.low) if e is not None)


def expert_step_ranges(timesteps: Sequence, boundary: float, first_step: int,
                       two_experts: bool) -> list[tuple[str, int, int]]:
    """(expert, first step, last step) runs in step order; step numbers count from 0 over the whole schedule."""
    ranges: list[tuple[str, int, int]] = []
    for offset, t in enumerate(timesteps):
        name = HIGH_NOISE if not two_experts or runs_high_noise_expert(t, boundary) else LOW_NOISE
        step = first_step + offset
        if ranges and ranges[-1][0] == name:
            ranges[-1] = (name, ranges[-1][1], step)
        else:
            ranges.append((name, step, step))
    return ranges


def describe_expert_steps(ranges: list[tuple[str, int, int]], *, two_experts: bool, sampler: str,
                          chained: bool) -> str:
    """E.g. "high-noise expert: steps 0-5, low-noise expert: steps 6-9"; one model is called "model"."""
    parts = []
    for name, first, last in ranges:
        label = name if two_experts else "model"
        parts.append(f"{label}: step {first}" if first == last else f"{label}: steps {first}-{last}")
    text = ", ".join(parts)
    if chained and sampler in MULTISTEP_SAMPLERS:
        text += (f" ({sampler} restarts its multistep history at step {ranges[0][1]}: a chain of samplers is close "
                 "to one run, euler makes it exact)")
    return text
