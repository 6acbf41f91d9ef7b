"""Fault injection for the hang tests, loaded into every worker (``WorkerPool(diagnostics=<this file>)``).

A model path whose name contains ``SLOW_LOAD`` makes the load sleep for an hour on every rank, standing in
for a load stuck on a slow disk or network share: the ranks stay alive (their heartbeats go on) but the
request cannot stop part-way.
"""

import time

from wanmesh.parallel.worker import residency

SLOW_LOAD = "wanmesh-slow-load"
_load_model = residency.ResidentModels.load_model


def _load_model_slowly(self, path, **options):
    if SLOW_LOAD in str(path):
        time.sleep(3600)
    return _load_model(self, path, **options)


residency.ResidentModels.load_model = _load_model_slowly
DIAGNOSTICS = {}
