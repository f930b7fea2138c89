"""Comparing two runs: their statistic records (`records`), or their tensor dumps (`tensors`).

Beside the job, never inside it: this package reads output through the read layer and is never
imported by the training hot path.
"""
