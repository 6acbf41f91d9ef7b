"""Sigma schedules of ComfyUI's schedulers for Wan's flow model, written for the workers (which run without ComfyUI).

Wan's flow model sampling (ComfyUI's discrete flow with a shift) holds a table of 1000 sigmas,
``sigma(t) = shift * t / (1 + (shift - 1) * t)`` at ``t = 1/1000 .. 1000/1000``; the model's timestep is
``sigma * 1000``. Each scheduler picks ``steps`` sigmas from it (or between its ends) and appends 0, with the same
float arithmetic as ComfyUI's, so a schedule here equals ComfyUI's of the same name (tests compare them with the
ComfyUI copy the tests install). Runs in the workers.
"""

from __future__ import annotations

import math

import numpy
import torch

TABLE_SIZE = 1000  # the flow model's discrete timesteps
TIMESTEP_SCALE = 1000.0  # the model's timestep is sigma x this
SCHEDULERS = ("simple", "normal", "beta", "sgm_uniform", "karras")
KARRAS_RHO = 7.0
BETA_ALPHA = BETA_BETA = 0.6


def shifted(shift: float, t):
    """The flow model's sigma of the unit time ``t`` (a float or a tensor)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def sigma_table(shift: float) -> torch.Tensor:
    """The 1000 sigmas, lowest first, float32 as ComfyUI's model sampling holds them."""
    return shifted(shift, (torch.arange(1, TABLE_SIZE + 1, 1) / TABLE_SIZE) * TIMESTEP_SCALE / TIMESTEP_SCALE)


def simple(table: torch.Tensor, steps: int, shift: float) -> list[float]:
    stride = len(table) / steps
    return [float(table[-(1 + int(x * stride))]) for x in range(steps)] + [0.0]


def normal(table: torch.Tensor, steps: int, shift: float, sgm: bool = False) -> list[float]:
    start, end = table[-1] * TIMESTEP_SCALE, table[0] * TIMESTEP_SCALE
    append_zero = True
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(shifted(shift, end / TIMESTEP_SCALE)), 0, abs_tol=0.00001):
            steps, append_zero = steps + 1, False
        timesteps = torch.linspace(start, end, steps)
    sigmas = [float(shifted(shift, timestep / TIMESTEP_SCALE)) for timestep in timesteps]
    return sigmas + [0.0] if append_zero else sigmas


def beta(table: torch.Tensor, steps: int, shift: float) -> list[float]:
    picks = numpy.rint(beta_quantiles(1 - numpy.linspace(0, 1, steps, endpoint=False)) * (len(table) - 1))
    sigmas, last = [], -1
    for pick in picks:
        if pick != last:
            sigmas.append(float(table[int(pick)]))
        last = pick
    return sigmas + [0.0]


def beta_quantiles(probabilities: numpy.ndarray) -> numpy.ndarray:
    """The Beta(0.6, 0.6) distribution's quantiles, as ComfyUI takes them (scipy.stats.beta.ppf): from scipy when
    it is installed, else from ``beta_ppf`` (scipy is not a dependency; the picks, rounded to the table, agree)."""
    try:
        import scipy.stats
    except ImportError:
        return numpy.array([beta_ppf(float(p), BETA_ALPHA, BETA_BETA) for p in probabilities])
    return scipy.stats.beta.ppf(probabilities, BETA_ALPHA, BETA_BETA)


def beta_ppf(probability: float, a: float, b: float) -> float:
    """The quantile of Beta(a, b): the x in [0, 1] where the regularized incomplete beta function reaches
    ``probability``, by bisection to float precision (monotone, so it always converges). Hand-written because
    neither torch nor numpy has the incomplete beta function."""
    if probability <= 0.0:
        return 0.0
    if probability >= 1.0:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(200):
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if regularized_beta(middle, a, b) < probability:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) by its continued fraction (modified Lentz), on the side where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - regularized_beta(1.0 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return math.exp(log_front) * fraction / a


def karras(table: torch.Tensor, steps: int, shift: float) -> list[float]:
    ramp = torch.linspace(0, 1, steps)
    low, high = float(table[0]) ** (1 / KARRAS_RHO), float(table[-1]) ** (1 / KARRAS_RHO)
    return ((high + ramp * (low - high)) ** KARRAS_RHO).tolist() + [0.0]


SCHEDULE_FUNCTIONS = {"simple": simple, "normal": normal, "beta": beta,
                      "sgm_uniform": lambda table, steps, shift: normal(table, steps, shift, sgm=True),
                      "karras": karras}


def schedule(scheduler: str, steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` sigmas (the last 0) of ``scheduler`` for the flow model with ``shift``, float32."""
    if scheduler not in SCHEDULE_FUNCTIONS:
        raise ValueError(f"scheduler {scheduler!r} is unknown; valid: {', '.join(SCHEDULERS)}")
    return torch.FloatTensor(SCHEDULE_FUNCTIONS[scheduler](sigma_table(shift), steps, shift))


def run_sigmas(scheduler: str, steps: int, shift: float, denoise: float = 1.0, start_step: int = 0,
               end_step: int | None = None, discard_penultimate: bool = False) -> torch.Tensor:
    """The sigmas a run steps through, as ComfyUI's KSampler and KSamplerAdvanced cut them: with denoise < 1 the
    last ``steps`` of a longer schedule; then up to ``end_step`` (the result keeps that step's noise) and from
    ``start_step``. ``discard_penultimate``: one step more, its next-to-last sigma dropped (uni_pc)."""
    def full(count: int) -> torch.Tensor:
        if not discard_penultimate:
            return schedule(scheduler, count, shift)
        longer = schedule(scheduler, count + 1, shift)
        return torch.cat([longer[:-2], longer[-1:]])

    sigmas = full(steps) if denoise > 0.9999 else full(int(steps / denoise))[-(steps + 1):]
    if end_step is not None and end_step < len(sigmas) - 1:
        sigmas = sigmas[:end_step + 1]
    return sigmas[start_step:] if start_step < len(sigmas) - 1 else sigmas[-1:]
