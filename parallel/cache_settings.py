"""Step-caching settings (method, threshold, step range, coefficients): their checks and the command line's
``--cache`` text; read in the driver (nodes, CLI) and carried as plain fields to the workers, where
``sampling/step_cache.py`` runs the cache. No torch here: the ComfyUI process and an idle worker load it cheaply.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHODS = ("teacache", "magcache", "fbcache")
COEFFICIENTS = ("auto", "generic")
DEFAULT_THRESHOLD = {"teacache": 0.2, "magcache": 0.12, "fbcache": 0.08}
MAGCACHE_K = 2  # MagCache's published default of consecutive skips


@dataclass(frozen=True)
class CacheSettings:
    """How a sampling run reuses the transformer's residual: ``method`` (teacache, magcache, fbcache), its
    ``threshold``, the share of the steps from which (``start_percent``, MagCache's retention ratio) and up to which
    (``end_percent``) steps may be skipped, the most consecutive skipped steps (``max_skips``; 0: MagCache's K of 2,
    no limit for the others) and the ``coefficients`` (auto: the published ones of the model, generic: the rule
    for unknown models)."""

    method: str
    threshold: float
    start_percent: float = 0.2
    end_percent: float = 1.0
    max_skips: int = 0
    coefficients: str = "auto"

    def validate(self) -> None:
        check_cache(self)

    @property
    def skip_limit(self) -> int | None:
        if self.max_skips > 0:
            return self.max_skips
        return MAGCACHE_K if self.method == "magcache" else None

    def describe(self) -> str:
        return (f"{self.method} threshold {self.threshold:g}, steps {self.start_percent:g}..{self.end_percent:g}"
                + (f", at most {self.skip_limit} skipped in a row" if self.skip_limit else ""))


def check_cache(settings: CacheSettings | None) -> None:
    """One-line errors for settings no run can use."""
    if settings is None:
        return
    if settings.method not in METHODS:
        raise ValueError(f"cache method {settings.method!r} is unknown; valid: {', '.join(METHODS)}")
    if not settings.threshold >= 0:
        raise ValueError(f"cache threshold {settings.threshold} is invalid; give a number >= 0 "
                         f"(e.g. {DEFAULT_THRESHOLD[settings.method]} for {settings.method})")
    for name in ("start_percent", "end_percent"):
        if not 0.0 <= getattr(settings, name) <= 1.0:
            raise ValueError(f"cache {name} {getattr(settings, name)} is outside 0..1")
    if settings.start_percent > settings.end_percent:
        raise ValueError(f"cache start_percent {settings.start_percent} is after end_percent "
                         f"{settings.end_percent}; give start <= end")
    if settings.max_skips < 0:
        raise ValueError(f"cache max_skips {settings.max_skips} is invalid; give 0 (the method's default) or more")
    if settings.coefficients not in COEFFICIENTS:
        raise ValueError(f"cache coefficients {settings.coefficients!r} are unknown; valid: {', '.join(COEFFICIENTS)}")


def check_stream_cache(settings: CacheSettings | None, use_kv_cache: bool) -> None:
    """Streaming caches steps only over the KV cache: without it every forward recomputes the earlier frames,
    whose unchanged tokens would enter the cache's statistic and change its decisions."""
    if settings is not None and not use_kv_cache:
        raise ValueError(f"step cache {settings.method} needs the KV cache while streaming; drop --no-kv-cache "
                         "(the uncached reference) or the step cache")


def cache_settings(fields: dict | CacheSettings | None) -> CacheSettings | None:
    """Settings from their fields as a request carries them (plain data crosses the worker boundary)."""
    if fields is None or isinstance(fields, CacheSettings):
        return fields
    try:
        return CacheSettings(**fields)
    except TypeError as exc:
        raise ValueError(f"cache settings {fields!r} are invalid: {exc}") from None


def cache_fields(settings: CacheSettings | None) -> dict | None:
    """The fields a request carries for settings (None for none)."""
    return None if settings is None else dataclasses.asdict(settings)


CACHE_KEYS = {"start": ("start_percent", float), "end": ("end_percent", float), "k": ("max_skips", int),
              "max_skips": ("max_skips", int), "coefficients": ("coefficients", str)}


def parse_cache(text: str | None) -> CacheSettings | None:
    """``METHOD[:THRESHOLD][:start=S][:end=E][:k=K][:coefficients=generic]`` (the command line's ``--cache``) as
    checked settings; None for none or an empty text."""
    if not text:
        return None
    method, *parts = text.split(":")
    if method not in METHODS:
        raise ValueError(f"--cache {text!r}: method {method!r} is unknown; valid: {', '.join(METHODS)} "
                         "(e.g. teacache:0.2, magcache:0.12:k=2, fbcache:0.08:start=0.1)")
    options: dict = {"threshold": DEFAULT_THRESHOLD[method]}
    for part in parts:
        key, eq, value = part.partition("=")
        try:
            if not eq:
                options["threshold"] = float(part)
                continue
            name, kind = CACHE_KEYS[key]
            options[name] = kind(value)
        except (KeyError, ValueError):
            raise ValueError(f"--cache {text!r}: {part!r} is not a threshold or one of "
                             f"{', '.join(k + '=' for k in CACHE_KEYS)}") from None
    settings = CacheSettings(method, **options)
    check_cache(settings)
    return settings


def describe_report(report: dict) -> str:
    """The log line of a run's cache report."""
    if not report:
        return ""
    steps = ", ".join(str(step + 1) for step in report["skipped_steps"]) or "none"
    numbers = report.get("numbers")
    rule = {None: "", "generic": "; the generic rule",
            "unpublished": "; the generic rule (no published numbers for this model)"}.get(
        numbers, f"; the published numbers of {numbers}")
    return (f"step cache {report['method']}: {report['computed']} steps computed, {report['skipped']} skipped "
            f"(steps {steps}); {report['calls']} transformer calls{rule}")
