"""ComfyUI's samplers for Wan's flow model, written for the workers (which run without ComfyUI).

Each solver steps a latent ``x`` through a sigma schedule, asking ``denoise(index, x, sigma)`` for the clean-latent
estimate at each step (the workers' guided model call: ``x - sigma * v``), with the same float arithmetic as
ComfyUI's k-diffusion samplers for a flow (CONST) model, so a run here equals ComfyUI's sampler of the same name
(tests compare every step rule with the ComfyUI copy the tests install). The noise of the ancestral steps comes
from ``noise(shape)``: the caller draws it as ComfyUI does (one generator seeded with the sampler seed, on the
latent's device, the whole batch at a time). Runs in the workers.
"""

from __future__ import annotations

from typing import Callable

import torch

Denoise = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
Noise = Callable[[], torch.Tensor]
SOLVERS = ("euler", "euler_ancestral", "dpmpp_2m", "lcm")


def euler(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    for i in range(len(sigmas) - 1):
        denoised = denoise(i, x, sigmas[i])
        derivative = (x - denoised) / sigmas[i]
        x = x + derivative * (sigmas[i + 1] - sigmas[i])
    return x


def euler_ancestral(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise,
                    eta: float = 1.0) -> torch.Tensor:
    """The flow-model form ComfyUI uses for CONST models: step down to sigma_down, then renoise to sigma_next."""
    for i in range(len(sigmas) - 1):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        denoised = denoise(i, x, sigma)
        if sigma_next == 0:
            x = denoised
            continue
        sigma_down = sigma_next * (1 + (sigma_next / sigma - 1) * eta)
        alpha_next, alpha_down = 1 - sigma_next, 1 - sigma_down
        renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_next ** 2 / alpha_down ** 2) ** 0.5
        ratio = sigma_down / sigma
        x = ratio * x + (1 - ratio) * denoised
        if eta > 0:
            x = (alpha_next / alpha_down) * x + noise() * renoise
    return x


def dpmpp_2m(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    """DPM-Solver++(2M) in log-sigma time."""
    def time_of(sigma):
        return sigma.log().neg()

    previous = None
    for i in range(len(sigmas) - 1):
        denoised = denoise(i, x, sigmas[i])
        t, t_next = time_of(sigmas[i]), time_of(sigmas[i + 1])
        h = t_next - t
        if previous is None or sigmas[i + 1] == 0:
            estimate = denoised
        else:
            r = (t - time_of(sigmas[i - 1])) / h
            estimate = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * previous
        x = (t_next.neg().exp() / t.neg().exp()) * x - (-h).expm1() * estimate
        previous = denoised
    return x


def lcm(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    """Latent consistency: jump to the clean estimate, then noise it to the next sigma (flow noise scaling)."""
    for i in range(len(sigmas) - 1):
        x = denoise(i, x, sigmas[i])
        if sigmas[i + 1] > 0:
            x = sigmas[i + 1] * noise() + (1.0 - sigmas[i + 1]) * x
    return x


SOLVER_FUNCTIONS = {"euler": euler, "euler_ancestral": euler_ancestral, "dpmpp_2m": dpmpp_2m, "lcm": lcm}


def solve(name: str, denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    if name not in SOLVER_FUNCTIONS:
        raise ValueError(f"sampler {name!r} has no worker-side solver; valid: {', '.join(SOLVERS)}")
    return SOLVER_FUNCTIONS[name](denoise, x, sigmas, noise)
