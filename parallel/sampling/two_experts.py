"""The worker side of a two-expert request: the low-noise expert's resident model, checked against the
high-noise one before any step runs, and the report of which steps each expert ran; runs in the workers.

Both experts are ordinary resident models (``worker/residency.py``), each loaded with this rank's plans, so
a switch between them inside the loop is a change of callable, never a reload. The step rule is in
``experts.py``.
"""

from __future__ import annotations

from ..config import check_same_expert_config
from ..protocol import SampleRequest
from .experts import describe_expert_steps, expert_step_ranges
from .loop import schedule_timesteps


def low_noise_expert(models, request: SampleRequest, high_model):
    """The low-noise expert of a request (None without one); a different architecture fails here, before sampling."""
    if request.handle_low is None:
        return None
    low_model = models._get(request.handle_low, "model")
    check_same_expert_config(dict(high_model.config), dict(low_model.config))
    return low_model


def expert_steps_report(request: SampleRequest) -> str:
    """E.g. "high-noise expert: steps 0-5, low-noise expert: steps 6-9" for the steps this request runs."""
    timesteps, first_step = schedule_timesteps(request)
    two_experts = request.handle_low is not None
    ranges = expert_step_ranges(timesteps, request.boundary, first_step, two_experts)
    return describe_expert_steps(ranges, two_experts=two_experts, sampler=request.sampler,
                                 chained=request.start_step > 0)
