"""Giving memory back on request (ComfyUI's "unload models" / "free memory"); runs in the driver process.

Neither action starts a pool: with no live pool they do nothing.
"""

from __future__ import annotations

from .driver.pool import close_cached_pool, current_pool
from .driver.worker_template import stop_template


def unload_pool_models() -> bool:
    """Unload every resident model of the live pool while its workers stay up: each rank frees its weights and
    hands the freed heap (and on GPUs the cached blocks) back to the system; the next prompt loads the models it
    names again in the same workers. The model code a worker imported stays (it is not freed by any unload;
    ``stop_pool`` gives that back too). True when a running pool was asked."""
    pool = current_pool()
    if pool is None or not pool.running:
        return False
    return pool.unload_models()


def stop_pool() -> bool:
    """Stop the live pool's workers (they exit) and the worker template that forked them (it holds the imported
    model code); the next use starts a fresh pool. True when either was running."""
    live = current_pool() is not None
    close_cached_pool()
    return stop_template() or live
