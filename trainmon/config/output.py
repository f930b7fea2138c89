"""Where a run writes: `$MONITOR_OUTPUT_DIR/<run>/rank_<R>/`, the same `<run>` on every rank."""
from __future__ import annotations

import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from trainmon.core.layout import rank_dir_name
from trainmon.core.version import __version__
from trainmon.core import ordering

DEFAULT_OUTPUT_DIR = "./monitor_output"
logger = logging.getLogger("trainmon")


def output_root() -> Path:
    return Path(os.environ.get("MONITOR_OUTPUT_DIR") or DEFAULT_OUTPUT_DIR)


def distributed_rank(process_group=None) -> tuple[int, int]:
    """(rank, world size): from torch.distributed when initialised, else from the launcher's env."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def agree_on_run_name(append_bounds: Sequence[str] = ()) -> str:
    """A run name shared by every rank, chosen on rank 0 and broadcast to all.

    With `append_bounds` ([start, end], the `append_output` key) the latest existing run whose name
    sorts between them is reused; otherwise a new timestamped run is made.
    """
    name = _existing_run(append_bounds) if append_bounds else None
    if name is None:
        if append_bounds:
            logger.warning("trainmon: no run under %s has a name between %s and %s; starting a new run",
                           output_root(), *append_bounds)
        name = _new_run_name()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        holder = [name]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
    return name


def _existing_run(bounds: Sequence[str]) -> Optional[str]:
    start, end = bounds
    root = output_root()
    runs = sorted(p.name for p in root.iterdir() if p.is_dir() and start <= p.name <= end) if root.is_dir() else []
    return runs[-1] if runs else None


def _new_run_name() -> str:
    name = time.strftime("run-%Y%m%d-%H%M%S")
    root = output_root()
    suffix, candidate = 1, name
    while (root / candidate).exists():
        suffix += 1
        candidate = f"{name}-{suffix}"
    return candidate


def rank_dir(run: str, rank: int) -> Path:
    return output_root() / run / rank_dir_name(rank)


def run_metadata(config: dict, rank: int, world_size: int, extra: dict) -> dict:
    """run.json; readers take the pipeline stage of CSV rows (which have no column for it) from `extra`'s
    `pp_stage`, and `ordering_key` says how they order records across ranks."""
    return {
        "rank": rank,
        "world_size": world_size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "versions": {"torch": torch.__version__, "python": platform.python_version(),
                     "trainmon": __version__},
        "ordering_key": ordering.DESCRIPTION,
        "config": config,
        **extra,
    }


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)

