"""The worker side of the pool; everything here runs in a worker process (one per device) or a Ray actor.

``main.py`` is the local worker process, ``runtime.py`` executes requests on one rank, ``executors.py`` and
``residency.py`` hold the rank's resident models and run the work on them with the rank's parallel plans.
"""
