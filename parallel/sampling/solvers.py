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
SOLVERS = ("euler", "euler_ancestral", "dpmpp_2m", "lcm", "uni_pc")


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


# -- uni_pc: ComfyUI's UniPC (bh1, data prediction, multistep of order up to 3, lower order at the end) ----------
# ComfyUI runs it in variance-exploding time: t = sigma, alpha_t = 1 / sqrt(1 + t^2), sigma_t = t / sqrt(1 + t^2),
# lambda_t = log(alpha_t / sigma_t); the model sees the latent scaled back by sqrt(1 + t^2).


def _log_alpha(t):
    return 0.5 * torch.log(1 / ((t * t) + 1))


def _alpha(t):
    return torch.exp(_log_alpha(t))


def _std(t):
    return torch.sqrt(1. - torch.exp(2. * _log_alpha(t)))


def _lambda(t):
    log_alpha = _log_alpha(t)
    return log_alpha - 0.5 * torch.log(1. - torch.exp(2. * log_alpha))


def _rows(v: torch.Tensor, dims: int) -> torch.Tensor:
    return v[(...,) + (None,) * (dims - 1)]


class _UniPC:
    """The data-prediction UniPC-bh1 steps; ``predict(x, t)`` is the clean-latent estimate at time t."""

    def __init__(self, denoise: Denoise):
        self.denoise = denoise
        self.calls = 0

    def predict(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sigma = t[0]
        scaled = x * ((sigma ** 2 + 1.0) ** 0.5)
        eps = (scaled - self.denoise(self.calls, scaled, sigma)) / sigma
        self.calls += 1
        dims = x.dim()
        return (x - _rows(_std(t), dims) * eps) / _rows(_alpha(t), dims)

    def update(self, x, models: list, times: list, t, order: int, use_corrector: bool):
        dims = x.dim()
        t_prev, model_prev = times[-1], models[-1]
        lambda_prev, lambda_t = _lambda(t_prev), _lambda(t)
        sigma_prev, sigma_t = _std(t_prev), _std(t)
        alpha_t = torch.exp(_log_alpha(t))
        h = lambda_t - lambda_prev
        rks, differences = [], []
        for i in range(1, order):
            rk = ((_lambda(times[-(i + 1)]) - lambda_prev) / h)[0]
            rks.append(rk)
            differences.append((models[-(i + 1)] - model_prev) / rk)
        rks.append(1.)
        rks = torch.tensor(rks, device=x.device)
        hh = -h[0]
        h_phi_1 = torch.expm1(hh)
        h_phi_k = h_phi_1 / hh - 1
        factorial, powers, b = 1, [], []
        for i in range(1, order + 1):
            powers.append(torch.pow(rks, i - 1))
            b.append(h_phi_k * factorial / hh)
            factorial *= (i + 1)
            h_phi_k = h_phi_k / hh - 1 / factorial
        R, b = torch.stack(powers), torch.tensor(b, device=x.device)
        D1s = torch.stack(differences, dim=1) if differences else None
        x_base = _rows(sigma_t / sigma_prev, dims) * x - _rows(alpha_t * h_phi_1, dims) * model_prev
        if D1s is not None:
            rhos_p = torch.tensor([0.5], device=b.device) if order == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1])
            x_t = x_base - _rows(alpha_t * hh, dims) * torch.tensordot(D1s, rhos_p, dims=([1], [0]))
        else:
            x_t = x_base - _rows(alpha_t * hh, dims) * 0
        if not use_corrector:
            return x_t, None
        rhos_c = torch.tensor([0.5], device=b.device) if order == 1 else torch.linalg.solve(R, b)
        model_t = self.predict(x_t, t)
        correction = torch.tensordot(D1s, rhos_c[:-1], dims=([1], [0])) if D1s is not None else 0
        x_t = x_base - _rows(alpha_t * hh, dims) * (correction + rhos_c[-1] * (model_t - model_prev))
        return x_t, model_t


def uni_pc(denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    """ComfyUI's uni_pc on its schedule (the caller drops the next-to-last sigma of a one-longer schedule, as
    ComfyUI does for this sampler). A final sigma of 0 becomes 0.001 in ``sigmas`` itself, in place: ComfyUI
    changes its schedule so, and its KSampler then scales the result by 1 - that sigma; the caller does the same."""
    times = sigmas
    if times[-1] == 0:
        times[-1] = 0.001
    x = x / torch.sqrt(1.0 + times[0] ** 2.0)
    steps, solver = len(times) - 1, _UniPC(denoise)
    order = min(3, len(times) - 2)
    t0 = times[0].expand(x.shape[0])
    models, history = [solver.predict(x, t0)], [t0]
    if order == 0:  # one step: ComfyUI's UniPC loop makes its first model call and ends before any update
        return x / _alpha(times[-1])
    for index in range(1, steps + 1):
        t = times[index].expand(x.shape[0])
        if index < order:
            x, model_x = solver.update(x, models, history, t, index, use_corrector=True)
            models.append(model_x)
            history.append(t)
            continue
        step_order = min(order, steps + 1 - index)
        x, model_x = solver.update(x, models, history, t, step_order, use_corrector=index != steps)
        for i in range(order - 1):
            history[i], models[i] = history[i + 1], models[i + 1]
        history[-1] = t
        if index < steps:
            models[-1] = model_x
    return x / _alpha(times[-1])


SOLVER_FUNCTIONS = {"euler": euler, "euler_ancestral": euler_ancestral, "dpmpp_2m": dpmpp_2m, "lcm": lcm,
                    "uni_pc": uni_pc}


def solve(name: str, denoise: Denoise, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    if name not in SOLVER_FUNCTIONS:
        raise ValueError(f"sampler {name!r} has no worker-side solver; valid: {', '.join(SOLVERS)}")
    return SOLVER_FUNCTIONS[name](denoise, x, sigmas, noise)
