"""The read layer: the one way to find a run's ranks and read its db, jsonl and CSV files (design §2).

It sits beside the job, never inside it, and opens every source read-only. Every command that reads a
run (`show`, `nan-analyze`, `anomalies`, the conversions) and `open_run` go through it; its one error,
`InputError`, names the file and line.
"""
from trainmon.read.errors import InputError
from trainmon.read.layout import RankDir, RunDirs, find_run
from trainmon.read.run import Run, open_run

__all__ = ["InputError", "RankDir", "Run", "RunDirs", "find_run", "open_run"]
