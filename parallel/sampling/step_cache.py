"""Step caching for the Wan transformer (TeaCache, MagCache, first-block cache) with one decision on every rank.

The settings (:class:`CacheSettings`, their checks and the ``--cache`` text) are ``parallel/cache_settings.py``,
read in the driver; this module runs in the workers. A cache wraps the transformer's block loop from outside, the model code staying single-device: a pre-hook
on the first block (after the context-parallel split) takes the loop's input, a forward wrapper on every block
returns its input unchanged on a skipped step, and a pre-hook on the output norm takes the loop's output: on a
computed step the residual (output minus input) is kept, on a skipped one the input plus the kept residual replaces
the output. First-block cache runs the first block every step and keeps the residual of the others. On a VACE
model the VACE blocks run before the main ones, so a pre-hook on the first VACE block takes the decision there and a
skipped step skips them too (first-block cache runs block 0 at that point and the model's call of it returns the
result); the kept residual, taken over the whole block stack, holds the VACE hints' effect.

Decisions come from statistics of the whole tensor: each rank sums its slice (the relative L1 change of the input or
of the first block's residual as sums of absolute values, padding tokens left out), the sums are all-reduced over
the ranks that hold other tokens (Ulysses, ring) or rows (data and CFG parallel on a model call), once per call,
and every rank applies the same rule to the same numbers. Tensor-parallel ranks hold the whole hidden state and
decide alike without a reduction. The sampler's two guidance passes keep separate caches and skip together: the
conditional pass decides and the unconditional one follows (with CFG parallel, one all-reduce over the cfg pair).
A causal stream (``sampling/stream.py``) runs one cache as a short run per chunk (:class:`ChunkedStepCache`).
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..cache_settings import CacheSettings  # noqa: F401  (the settings a StepCache runs with)
from .cache_tables import MAGCACHE_RATIOS, TEACACHE_POLYNOMIALS, wan_variant

log = logging.getLogger("wanmesh")


# ---------------------------------------------------------------------------------------------------------------
# The rules: each turns a step's whole-tensor sums into "compute" or "skip"
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class PassState:
    """One pass's cache (the conditional or unconditional one, or a model call's rows)."""

    residual: torch.Tensor | None = None  # output of the skipped blocks minus their input, float32
    previous: torch.Tensor | None = None  # the statistic's tensor at the last step (TeaCache) or compute (FBCache)
    accumulated: float = 0.0
    ratio: float = 1.0  # MagCache: the product of magnitude ratios since the last computed step
    skips: int = 0  # steps skipped in a row
    residual_sq: float = 0.0  # MagCache generic rule: the local sum of squares of the last computed residual
    norms: list = field(default_factory=list)  # MagCache generic rule: (step, norm) of computed residuals
    slot: int = 0  # which pass: 0 decides the step
    last_computed: int = -1  # the last step this pass computed
    pending: torch.Tensor | None = None  # FBCache: this step's first-block residual, kept if the step is computed


def _l1_sums(current: torch.Tensor, previous: torch.Tensor | None) -> list[float]:
    if previous is None or previous.shape != current.shape:
        return [0.0, 0.0, 1.0]  # no history: the third entry marks "compute"
    return [float((current - previous).abs().sum(dtype=torch.float64)),
            float(previous.abs().sum(dtype=torch.float64)), 0.0]


class TeaCacheRule:
    """TeaCache: the relative L1 change of the timestep-modulated input, rescaled by the model's polynomial and
    accumulated over skipped steps; a step is computed once the sum reaches the threshold. Known Wan models use the
    timestep projection (as published); others the first block's modulated input and no rescaling."""

    when = "before"
    width = 3

    def __init__(self, polynomial: tuple[float, ...] | None):
        self.polynomial = polynomial

    def local_sums(self, state: PassState, block, hidden, temb, valid) -> list[float]:
        current = (temb.float() if self.polynomial is not None
                   else modulated_input(block, hidden, temb)[:, :valid])
        sums = _l1_sums(current, state.previous)
        state.previous = current
        return sums

    def decide(self, state: PassState, sums: list[float], step: int, skippable: bool) -> bool:
        if sums[2] > 0 or not skippable or sums[1] == 0:
            state.accumulated = 0.0
            return True
        change = sums[0] / sums[1]
        if self.polynomial is not None:
            change = sum(c * change ** (len(self.polynomial) - 1 - i) for i, c in enumerate(self.polynomial))
        state.accumulated += change
        if state.accumulated < self.threshold:
            return False
        state.accumulated = 0.0
        return True


class MagCacheRule:
    """MagCache: the magnitude ratio of consecutive residuals (published per step, or for unknown models measured
    on the computed steps, whole-tensor norms) multiplied over skipped steps; the error |1 - ratio| accumulates,
    and a step is computed when the error reaches the threshold or K steps were skipped."""

    when = "before"
    width = 2

    def __init__(self, ratios: tuple[float, ...] | None, steps: int):
        self.published = None if ratios is None else ratios[0::2]  # the conditional pass's
        self.steps = steps

    @functools.cached_property
    def _tables(self) -> dict:
        return {}

    @property
    def ratios(self) -> list[float] | None:
        if self.published is None:
            return None
        if self.steps not in self._tables:
            self._tables[self.steps] = _nearest(self.published, self.steps)
        return self._tables[self.steps]

    def local_sums(self, state: PassState, block, hidden, temb, valid) -> list[float]:
        return [state.residual_sq, 0.0]

    def decide(self, state: PassState, sums: list[float], step: int, skippable: bool) -> bool:
        if sums[0] > 0 and (not state.norms or state.norms[-1][0] != state.last_computed):
            state.norms.append((state.last_computed, sums[0] ** 0.5))
        ratio = self._ratio(state, step)
        if ratio is None or not skippable:
            return self._reset(state)
        state.ratio *= ratio
        state.accumulated += abs(1.0 - state.ratio)
        if state.accumulated < self.threshold:
            return False
        return self._reset(state)

    def _ratio(self, state: PassState, step: int) -> float | None:
        if self.ratios is not None:
            return float(self.ratios[min(step, len(self.ratios) - 1)])
        if len(state.norms) < 2:
            return None
        (s0, n0), (s1, n1) = state.norms[-2:]
        return (n1 / n0) ** (1.0 / max(1, s1 - s0)) if n0 > 0 else None

    @staticmethod
    def _reset(state: PassState) -> bool:
        state.accumulated, state.ratio = 0.0, 1.0
        return True


class FirstBlockRule:
    """First-block cache (cache-dit's rule with one front block): the relative L1 change of the first block's
    residual against the last computed step's; below the threshold the other blocks are skipped and their kept
    residual is added to the first block's output."""

    when = "after"
    width = 3

    def local_sums(self, state: PassState, block, first_residual, temb, valid) -> list[float]:
        current = first_residual[:, :valid].float()
        sums = _l1_sums(current, state.previous)
        state.pending = current
        return sums

    def decide(self, state: PassState, sums: list[float], step: int, skippable: bool) -> bool:
        compute = sums[2] > 0 or not skippable or sums[1] == 0 or sums[0] / sums[1] >= self.threshold
        if compute:
            state.previous = state.pending
        return compute


def _nearest(values: tuple[float, ...], steps: int) -> list[float]:
    """A published 50-step table (steps 2..50) for ``steps`` steps: step 1 has no ratio (1.0), the others take the
    nearest entry."""
    table = (1.0, *values)
    if steps <= 1:
        return [table[-1]]
    scale = (len(table) - 1) / (steps - 1)
    return [table[round(i * scale)] for i in range(steps)]


def modulated_input(block, hidden: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
    """A Wan block's self-attention input: its norm of the hidden state scaled and shifted by the timestep (what the
    block computes first; diffusers' WanTransformerBlock)."""
    table = block.scale_shift_table
    if temb.ndim == 4:  # one timestep per token
        shift, scale = (table.unsqueeze(0) + temb.float())[:, :, 0], (table.unsqueeze(0) + temb.float())[:, :, 1]
    else:
        shift, scale = (table + temb.float())[:, 0:1], (table + temb.float())[:, 1:2]
    return block.norm1(hidden.float()) * (1 + scale) + shift


def make_rule(settings: CacheSettings, model, steps: int, tokens_per_frame: int, experts: int = 1):
    """The rule for a model: the published numbers of a known Wan model, the generic rule (with a log line) else;
    ``experts``: the models of the run (2: a Wan 2.2 A14B pair)."""
    variant = None if settings.coefficients == "generic" else wan_variant(model.config, tokens_per_frame, experts)
    if settings.method == "teacache":
        polynomial = TEACACHE_POLYNOMIALS.get(variant)
        rule = TeaCacheRule(polynomial)
        known = polynomial is not None
    elif settings.method == "magcache":
        ratios = MAGCACHE_RATIOS.get(variant)
        rule = MagCacheRule(ratios, steps)
        known = ratios is not None
    else:
        rule, known = FirstBlockRule(), True
    rule.threshold = settings.threshold
    # what the report names: the published numbers' model, "unpublished" (the generic rule as the fallback) or
    # "generic" (asked for); fbcache has no per-model numbers
    rule.numbers = (None if settings.method == "fbcache" else variant if known
                    else "generic" if settings.coefficients == "generic" else "unpublished")
    if known and rule.numbers is not None:
        log.info("step cache: the published %s numbers of %s", settings.method, variant)
    elif not known and settings.coefficients == "auto":
        log.info("step cache: no published %s numbers for this model (%s); using the generic rule", settings.method,
                 variant or "not a released Wan shape")
    return rule


# ---------------------------------------------------------------------------------------------------------------
# The cache on a model: hooks, the per-step state, the collective decision
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Reduction:
    """Where a decision's sums and decisions travel: ``sum_groups`` (all-reduced in turn), and with CFG parallel on
    the sampler the cfg pair (``follow_group``) over which the unconditional pass takes the conditional one's
    decision; ``slot`` is then this rank's pass (its cfg index)."""

    sum_groups: tuple = ()
    follow_group: object = None
    slot: int = 0


class StepCache:
    """One model's cache over one sampling run (or the model calls of one ComfyUI sampler run)."""

    def __init__(self, settings: CacheSettings, model, reduction: Reduction, steps: int, tokens_per_frame: int,
                 shard=None, experts: int = 1):
        self.settings, self.reduction = settings, reduction
        self.shard = shard  # () -> this forward's SequenceShard when the sequence is split outside the model's plan
        self._model = weakref.ref(model)  # a cache kept between model calls must not keep an unloaded model alive
        self.rule = make_rule(settings, model, steps, tokens_per_frame, experts)
        self.passes: dict[int, PassState] = {}
        self.step, self.steps, self.pass_count, self.next_slot = -1, steps, 1, 0
        self.decisions: dict[int, bool] = {}  # step -> computed (the deciding pass's)
        self.calls = 0  # transformer calls that ran the blocks
        self._current: PassState | None = None
        self._skipping = False
        self._decided = False  # this call's decision is taken (before the VACE blocks on a VACE model)
        self._early_first: torch.Tensor | None = None  # fbcache on a VACE model: block 0's output, computed early
        self._anchor: torch.Tensor | None = None  # the blocks' input (the first block's output for fbcache)
        self._temb: torch.Tensor | None = None
        self._handles: list = []
        self._forwards: list = []

    @property
    def model(self):
        return self._model()

    # -- the run ---------------------------------------------------------------------------------------------

    def at_step(self, index: int, steps: int | None = None, passes: int = 1) -> None:
        """The next model calls belong to step ``index`` (0-based over ``steps``) with ``passes`` guidance passes."""
        if index < self.step:  # a new run on the same cache (model calls of a new sampler run)
            self.reset()
        if index != self.step:
            self.next_slot = 0  # the same step again: the call is the step's next pass
        self.step, self.pass_count = index, passes
        if steps:
            self.steps = self.rule.steps = steps
        self._end_call()

    def _end_call(self) -> None:
        self._current, self._skipping, self._decided, self._early_first = None, False, False, None

    def reset(self) -> None:
        self.passes.clear()
        self.decisions.clear()
        self.step, self.calls = -1, 0

    def skippable(self) -> bool:
        share = self.step / max(1, self.steps)
        return self.settings.start_percent <= share and (share < self.settings.end_percent
                                                         or self.settings.end_percent >= 1.0)

    def report(self) -> dict:
        """Which steps were computed and skipped (by the deciding pass) and the transformer calls that ran."""
        skipped = sorted(step for step, computed in self.decisions.items() if not computed)
        return {"method": self.settings.method, "numbers": self.rule.numbers,
                "computed": len(self.decisions) - len(skipped),
                "skipped": len(skipped), "skipped_steps": skipped, "calls": self.calls}

    # -- hooks -----------------------------------------------------------------------------------------------

    def install(self) -> "StepCache":
        blocks, vace_blocks = self.model.blocks, list(getattr(self.model, "vace_blocks", None) or ())
        if vace_blocks:  # the VACE blocks run before the main ones: the decision is taken before them
            self._handles.append(vace_blocks[0].register_forward_pre_hook(self._enter_vace, with_kwargs=True))
        self._handles.append(blocks[0].register_forward_pre_hook(self._enter_blocks, with_kwargs=True))
        if self.rule.when == "after":
            self._handles.append(blocks[0].register_forward_hook(self._after_first_block))
        self._handles.append(self.model.norm_out.register_forward_pre_hook(self._leave_blocks))
        for index, block in enumerate(blocks):
            original = block.forward
            block.forward = self._wrapped(original, first=index == 0)
            self._forwards.append((block, original))
        for block in vace_blocks:
            original = block.forward
            block.forward = self._wrapped_vace(original)
            self._forwards.append((block, original))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for block, original in self._forwards:
            if block.__dict__.get("forward") is not None:
                del block.forward  # the class's forward again
        self._handles.clear()
        self._forwards.clear()

    def _wrapped(self, original, first: bool):
        @functools.wraps(original)
        def forward(hidden_states, *args, **kwargs):
            if first and self._early_first is not None:  # computed before the VACE blocks to decide
                output, self._early_first = self._early_first, None
                return output
            if self._skipping and not (first and self.rule.when == "after"):
                return hidden_states
            return original(hidden_states, *args, **kwargs)

        forward.step_cache_original = original
        return forward

    def _wrapped_vace(self, original):
        """A VACE block that computes nothing on a skipped step: its hint is a zero (the kept residual, taken
        over the whole block stack, already holds the hints' effect) and the control tokens pass unchanged."""

        @functools.wraps(original)
        def forward(hidden_states, encoder_hidden_states, control_hidden_states, *args, **kwargs):
            if self._skipping:
                return hidden_states.new_zeros(()), control_hidden_states
            return original(hidden_states, encoder_hidden_states, control_hidden_states, *args, **kwargs)

        return forward

    def _begin_call(self, hidden) -> bool:
        """This call's pass state; False for a call outside a tracked step (computed, nothing kept)."""
        slot = self.reduction.slot if self.pass_count > 1 and self.reduction.follow_group is not None \
            else self.next_slot
        self.next_slot += 1
        self._decided = True
        if self.step < 0:
            self._current, self._skipping = None, False
            return False
        self._current = self.passes.setdefault(slot, PassState(slot=slot))
        self._anchor = hidden
        return True

    def _enter_vace(self, vace_block, args, kwargs):
        """Before the first VACE block (after its sequence split): the call's decision, so that a skipped step
        skips the VACE blocks too. Its hidden state is the main blocks' input. First-block cache runs block 0
        here (its output is reused when the model calls it) since its decision needs that block's residual."""
        if self._decided:  # the same call's next VACE context
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        text, temb, rotary = _vace_block_inputs(args, kwargs)
        if not self._begin_call(hidden):
            return None
        first = self.model.blocks[0]
        if self.rule.when == "before":
            self._skipping = not self._decide(first, hidden, temb)
            return None
        current = first.__dict__.get("forward")
        run_first = getattr(current, "step_cache_original", current) or first.forward
        self._temb = temb
        self._early_first = run_first(hidden, text, temb, rotary)
        self._first_block_decision(first, self._early_first)
        return None

    def _enter_blocks(self, block, args, kwargs):
        hidden, temb = _block_inputs(block, args, kwargs)
        if self._decided:  # decided before the VACE blocks
            if self.rule.when == "before" and self._current is not None:
                self._anchor = hidden
            return None
        if not self._begin_call(hidden):
            return None
        self._decided = self.rule.when == "before"
        if self.rule.when == "before":
            self._skipping = not self._decide(block, hidden, temb)
        else:
            self._skipping, self._temb = False, temb
        return None

    def _after_first_block(self, block, args, output):
        if self._current is None or self._decided:
            return None
        self._first_block_decision(block, output)
        return None

    def _first_block_decision(self, block, output) -> None:
        first_residual = output.float() - self._anchor.float()
        self._skipping = not self._decide(block, first_residual, self._temb)
        self._anchor = output  # the other blocks' residual is kept against the first block's output
        self._decided = True

    def _leave_blocks(self, module, args):
        state = self._current
        skipping = self._skipping
        self._end_call()
        if state is None:
            self.calls += 1
            return None
        if skipping:
            state.skips += 1
            return (self._anchor.float() + state.residual,)
        self.calls += 1
        state.skips = 0
        state.residual = args[0].float() - self._anchor.float()
        state.last_computed = self.step
        if isinstance(self.rule, MagCacheRule):
            state.residual_sq = float(state.residual[:, : self._valid_tokens(state.residual)].pow(2).sum(
                dtype=torch.float64))
        return None

    # -- the decision ----------------------------------------------------------------------------------------

    def _decide(self, block, tensor, temb) -> bool:
        """Whether this pass computes the step: the same answer on every rank. The deciding pass (the conditional
        one, or every model call of its own) reduces its sums; the other pass takes its decision, locally or over
        the cfg pair."""
        state = self._current
        exchange = self.pass_count > 1 and self.reduction.follow_group is not None
        if self.pass_count > 1 and state.slot > 0:
            computed = self._exchange(False, tensor.device) if exchange else self.decisions.get(self.step, True)
        else:
            computed = self._leader_decision(block, tensor, temb, state)
            if exchange:
                computed = self._exchange(computed, tensor.device)
        if state.slot == 0 or exchange:
            self.decisions[self.step] = computed
        return computed or not self._has_residual(state)

    def _has_residual(self, state: PassState) -> bool:
        return state.residual is not None and state.residual.shape == self._anchor.shape

    def _exchange(self, computed: bool, device) -> bool:
        """The deciding pass's decision on both ranks of the cfg pair (the other contributes nothing)."""
        flag = torch.tensor([1.0 if computed else 0.0], dtype=torch.float64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.reduction.follow_group)
        return bool(flag.item() > 0)

    def _leader_decision(self, block, tensor, temb, state: PassState) -> bool:
        valid = self._valid_tokens(tensor)
        sums = torch.tensor(self.rule.local_sums(state, block, tensor, temb, valid), dtype=torch.float64,
                            device=tensor.device)
        for group in self.reduction.sum_groups:
            dist.all_reduce(sums, group=group)
        limit = self.settings.skip_limit
        skippable = self.skippable() and self._has_residual(state) and (limit is None or state.skips < limit)
        return self.rule.decide(state, sums.tolist(), self.step, skippable)

    def _valid_tokens(self, tensor: torch.Tensor) -> int:
        """This rank's real tokens along the sequence (context parallel pads the last slices)."""
        context = getattr(self.model, "context_parallel", None)
        shard = self.shard() if self.shard is not None else getattr(context, "shard", None)
        if shard is None:
            return tensor.shape[1]
        return max(0, min(shard.local_len, shard.valid_len - shard.index * shard.local_len))


def _vace_block_inputs(args, kwargs) -> tuple:
    """(encoder_hidden_states, temb, rotary_emb) of a VACE block call (diffusers' WanVACETransformerBlock)."""
    names = ("hidden_states", "encoder_hidden_states", "control_hidden_states", "temb", "rotary_emb")
    values = dict(zip(names, args)) | kwargs
    return values["encoder_hidden_states"], values["temb"], values["rotary_emb"]


def _block_inputs(block, args, kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states, temb) of a Wan block call (diffusers calls blocks positionally)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    temb = args[2] if len(args) > 2 else kwargs["temb"]
    return hidden, temb


class StepCaches:
    """The caches of one sampling run's models (both experts of a Wan 2.2 A14B run), installed while it runs."""

    def __init__(self, caches: list[StepCache]):
        self.caches = caches

    def __enter__(self) -> "StepCaches":
        for cache in self.caches:
            cache.install()
        return self

    def __exit__(self, *exc) -> None:
        for cache in self.caches:
            cache.remove()

    def at_step(self, index: int, steps: int, passes: int) -> None:
        for cache in self.caches:
            cache.at_step(index, steps, passes)

    def decisions(self) -> dict[int, bool]:
        """step -> computed, over the run's models (each step runs one of them)."""
        decisions: dict[int, bool] = {}
        for cache in self.caches:
            decisions.update(cache.decisions)
        return decisions

    def report(self) -> dict:
        """The run's computed and skipped steps and its transformer calls."""
        decisions = self.decisions()
        skipped = sorted(step for step, computed in decisions.items() if not computed)
        return {"method": self.caches[0].settings.method, "numbers": self.caches[0].rule.numbers,
                "computed": len(decisions) - len(skipped),
                "skipped": len(skipped), "skipped_steps": skipped, "calls": sum(c.calls for c in self.caches)}


class ChunkedStepCache:
    """A step cache over a causal stream: each chunk is its own short run, so the steps count from 0 again and the
    passes start without history (nothing of the previous chunk's input or residual is reused); the pass at
    timestep 0 that writes a chunk to the KV cache runs outside the steps (always computed, keeping nothing).
    Decisions are reported over the whole stream, step ``chunk * steps + step``."""

    def __init__(self, cache: StepCache, steps: int):
        self.cache, self.steps = cache, steps
        self.history: dict[int, bool] = {}
        self.chunk = -1

    def __enter__(self) -> "ChunkedStepCache":
        self.cache.install()
        return self

    def __exit__(self, *exc) -> None:
        self.cache.remove()

    def start_chunk(self, index: int) -> None:
        self._keep_decisions()
        self.chunk = index
        self.cache.passes.clear()
        self.cache.decisions.clear()
        self.cache.step = -1

    def at_step(self, step: int, passes: int) -> None:
        self.cache.at_step(step, self.steps, passes)

    def outside_steps(self) -> None:
        """The next calls (the KV cache write) are computed and leave the passes' state alone."""
        self.cache.step = -1

    def _keep_decisions(self) -> None:
        for step, computed in self.cache.decisions.items():
            self.history[self.chunk * self.steps + step] = computed
        self.cache.decisions.clear()

    def decisions(self) -> dict[int, bool]:
        self._keep_decisions()
        return dict(self.history)

    def report(self) -> dict:
        decisions = self.decisions()
        skipped = sorted(step for step, computed in decisions.items() if not computed)
        return {"method": self.cache.settings.method, "numbers": self.cache.rule.numbers,
                "computed": len(decisions) - len(skipped),
                "skipped": len(skipped), "skipped_steps": skipped, "calls": self.cache.calls}


def check_same_decisions(decisions: dict[int, bool], steps: int, device) -> None:
    """Every rank took the same decisions (a guard: ranks that diverged would give wrong latents or hang). Ranks
    that sampled no rows (a data-parallel replica without rows) made none and are left out. Collective: every rank
    of the pool calls it after the run."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.full((steps,), -1.0, dtype=torch.float64, device=device)
    for step, computed in decisions.items():
        if 0 <= step < steps:
            mine[step] = float(computed)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    patterns = {tuple(p.tolist()) for p in everyone if (p >= 0).any()}
    if len(patterns) > 1:
        raise RuntimeError("step cache: the ranks took different skip decisions "
                           f"({len(patterns)} patterns); this is a bug, sample without the cache")
