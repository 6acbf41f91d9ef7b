"""Benchmarks behind `wanmesh bench ...`; they run in the CLI process and in ranks they spawn.
``common.py`` holds what they share (argument parsing, timing, tables)."""
