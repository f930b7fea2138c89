"""The run layout: where a run's files are and what they are called.

    <output root>/<run>/rank_<R>/   run.json, <family>_<first>-<last>.csv, monitor.db or records.stream,
                                    anomalies.jsonl, stack_info.json, cc_log.json, module_struct.json,
                                    dynamic_state.json, anomaly_dumps/, dumps/step<S>/{index.json,
                                    tensors.safetensors}

msprobe's monitor writes `<Mon DD_HH-MM-SS>-rank<R>-<uuid8>/` rank directories with the same CSV files, and
its dumps `step<S>/rank<R>/` (or `proc<N>`); the readers take both.
"""
from __future__ import annotations

import re

RUN_JSON = "run.json"                  # what the rank's job was: config, parallel layout, writer report
WRITER_REPORT = "writer"               # run.json's key of the writer's report, added at stop(): the rank finished
ANOMALIES_FILE = "anomalies.jsonl"     # one AnomalyEvent per line
DB_NAME = "monitor.db"                 # the database sink (local filesystems)
STREAM_NAME = "records.stream"         # the database sink's record stream (network filesystems)
STACK_INFO_FILE = "stack_info.json"     # stack_info: where each module is called from
CC_LOG_FILE = "cc_log.json"             # cc_distribution.cc_log_only: the collectives used
MODULE_STRUCT_FILE = "module_struct.json"  # the module tree in model order (print_struct, save_structure)
DYNAMIC_STATE_FILE = "dynamic_state.json"  # dynamic_on: the config changes applied, and when
WATCH_STATE_FILE = "watch_state.json"  # trainmon watch's state, in its log directory
WATCHED_RUN = "run"                    # that file's key naming the run directory the view is of
ANOMALY_DUMPS_DIR = "anomaly_dumps"    # alert.dump: the first anomalous module's tensors
DUMPS_DIR, INDEX_FILE, TENSOR_FILE = "dumps", "index.json", "tensors.safetensors"  # the `dump` block
DUMP_STEP_DIR = re.compile(r"^step(\d+)$")               # a step's directory of dumps (trainmon's and msprobe's)

_RANK_PREFIX = "rank_"
RANK_DIR = re.compile(r"^rank_(\d+)$|-rank(\d+)-")       # trainmon's and msprobe's monitor rank directories
TRAINMON_RANK_DIR = re.compile(r"^rank_\d+$")             # trainmon's only (what a conversion writes)
DUMP_RANK_DIR = re.compile(r"^(?:rank_?(\d*)|proc\d+)$")  # rank directories of trainmon's and msprobe's dumps
FAMILY_FILE = re.compile(  # a family's CSV file: <family>_<first step>-<last step>.csv
    r"^(?P<family>.+)_(?P<first>\d+)-(?P<last>\d+)\.csv$")


def rank_dir_name(rank: int) -> str:
    """The directory of global rank `rank` in a run."""
    return f"{_RANK_PREFIX}{rank}"


def dump_step_dir_name(step: int) -> str:
    """The directory of step `step`'s dumps, under `dumps/` (`DUMP_STEP_DIR`)."""
    return f"step{step}"


def family_file_name(family: str, first: int, last: int) -> str:
    """The CSV file of `family`'s records of steps first..last (msprobe's name)."""
    return f"{family}_{first}-{last}.csv"
