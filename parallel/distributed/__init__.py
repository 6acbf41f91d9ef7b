"""Distributed execution; runs in the worker processes (and benchmark ranks): the mesh and its process groups,
group arithmetic, counted collectives, attention (local kernel seam, ring, Ulysses), the tensor- and
context-parallel plans, and the VAE patch-parallel split/exec/merge executor."""
