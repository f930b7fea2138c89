"""Tensor dumps as comparison input: trainmon's (`dump` config block) and msprobe's (`task: tensor`).

trainmon: `<rank dir>/dumps/step<S>/index.json` and `tensors.safetensors` (trainmon.hooks.tensor_dump
writes them). Accepted: a run directory, a rank directory, its `dumps/` directory or one step directory.
msprobe: `<dump_path>/step<S>/rank<R>/dump.json` with `dump_tensor_data/<data_name>` files (`.pt`, or
`.npy`); entries in execution order, each tensor naming its file in `data_name`. Its `stack.json` gives
the stacks (`{"<i>": [[entry names], [frames]]}`, or `{"<entry>": [frames]}` in older versions).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional

from trainmon.core.layout import (DB_NAME, DUMP_RANK_DIR, DUMP_STEP_DIR, DUMPS_DIR, INDEX_FILE, STREAM_NAME,
                                   TENSOR_FILE)
from trainmon.read.errors import InputError

if TYPE_CHECKING:  # torch is imported when a tensor is loaded: finding dumps needs none
    import torch
_MS_ENTRY = re.compile(r"^(?P<module>.+)\.(?P<phase>forward|backward)(?:\.(?P<n>\d+))?$")


@dataclass
class DumpTensor:
    """One dumped tensor: where it was taken, how to load it, and its statistic record."""

    order: int                  # call order within the step
    module: str                 # module path, or msprobe's API call (`Functional.linear.0`)
    phase: str                  # forward or backward
    role: str                   # input_0, output, grad_input_0, ...
    micro_step: Optional[int]
    shape: list
    dtype: str
    load: Optional[Callable[[], torch.Tensor]]  # None: not stored (cut by the size cap)
    record: Optional[dict] = None
    occurrence: int = 0         # how many earlier calls of the same module, phase, role this step had

    @property
    def key(self) -> tuple:
        return self.micro_step, self.module, self.phase, self.role, self.occurrence


@dataclass
class StepDump:
    """The dump of one rank at one step."""

    rank: int
    step: int
    source: Path
    tensors: list = field(default_factory=list)
    stacks: dict = field(default_factory=dict)  # module -> frames of its first call
    cut: list = field(default_factory=list)


def _number_occurrences(tensors: list[DumpTensor]) -> None:
    seen: dict = {}
    for t in tensors:
        base = (t.micro_step, t.module, t.phase, t.role)
        t.occurrence = seen.get(base, 0)
        seen[base] = t.occurrence + 1


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise InputError.at(path, f"cannot read: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise InputError.at(path, f"not JSON: {err.msg}", err.lineno) from None


# ---- trainmon ----------------------------------------------------------------------------------
def _trainmon_indexes(path: Path) -> list[Path]:
    for pattern in (INDEX_FILE, f"step*/{INDEX_FILE}", f"{DUMPS_DIR}/step*/{INDEX_FILE}",
                    f"*/{DUMPS_DIR}/step*/{INDEX_FILE}"):
        found = sorted(path.glob(pattern))
        if found:
            return found
    return []


def _read_trainmon(index_path: Path) -> StepDump:
    index = _json(index_path)
    try:
        dump = StepDump(int(index["rank"]), int(index["step"]), index_path.parent, stacks=index.get("stacks", {}),
                        cut=index.get("cut", []))
        tensor_file = index_path.parent / index.get("file", TENSOR_FILE)
        for entry in index["tensors"]:
            stored = entry.get("stored", True)
            dump.tensors.append(DumpTensor(
                int(entry["call"]), entry["module"], entry["phase"], entry["role"], entry.get("micro_step"),
                entry["shape"], entry["dtype"], _safetensor(tensor_file, entry["key"]) if stored else None,
                entry.get("record")))
    except (KeyError, TypeError, ValueError) as err:
        raise InputError.at(index_path, f"not a trainmon dump index ({type(err).__name__}: {err})") from None
    _number_occurrences(dump.tensors)
    return dump


def _safetensor(path: Path, key: str) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as fh:
                return fh.get_tensor(key)
        except (OSError, SafetensorError) as err:
            raise InputError.at(path, f"cannot read tensor {key!r}: {err}") from None
    return load


# ---- msprobe -----------------------------------------------------------------------------------
def _msprobe_files(path: Path) -> list[Path]:
    for pattern in ("dump.json", "*/dump.json", "*/*/dump.json"):
        found = [p for p in sorted(path.glob(pattern)) if (p.parent / "dump_tensor_data").is_dir()]
        if found:
            return found
    return []


def _tensor_leaves(value, prefix: str) -> Iterator[tuple[str, dict]]:
    if isinstance(value, dict) and "data_name" in value:
        yield prefix, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensor_leaves(item, f"{prefix}_{i}")
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from _tensor_leaves(item, f"{prefix}_{k}")


def _load_file(path: Path) -> Callable[[], torch.Tensor]:
    def load() -> torch.Tensor:
        import torch

        try:
            if path.suffix == ".npy":
                import numpy as np

                return torch.from_numpy(np.load(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises many types on a bad file
            raise InputError.at(path, f"cannot read the tensor ({type(err).__name__}: {err})") from None
    return load


def _msprobe_stacks(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = _json(path)
    stacks = {}
    for key, value in data.items() if isinstance(data, dict) else ():
        if isinstance(value, list) and len(value) == 2 and isinstance(value[0], list):
            for name in value[0]:
                stacks[name] = value[1]
        else:
            stacks[key] = value
    return stacks


def _read_msprobe(dump_json: Path) -> StepDump:
    data = _json(dump_json)
    rank_dir, step_dir = dump_json.parent, dump_json.parent.parent
    step = DUMP_STEP_DIR.match(step_dir.name)
    rank = DUMP_RANK_DIR.match(rank_dir.name)
    dump = StepDump(int(rank.group(1) or 0) if rank else 0, int(step.group(1)) if step else 0, rank_dir)
    raw_stacks = _msprobe_stacks(rank_dir / "stack.json")
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise InputError.at(dump_json, 'not an msprobe dump: no "data" object')
    for order, (name, entry) in enumerate(entries.items()):
        match = _MS_ENTRY.match(name)
        module, phase = (match["module"], match["phase"]) if match else (name, "forward")
        if name in raw_stacks:
            dump.stacks.setdefault(module, raw_stacks[name])
        for part, value in (entry.items() if isinstance(entry, dict) else ()):
            for role, leaf in _tensor_leaves(value, part):
                record = {k.lower(): leaf[k] for k in ("Max", "Min", "Mean", "Norm") if k in leaf}
                dump.tensors.append(DumpTensor(order, module, phase, role, None, leaf.get("shape", []),
                                               str(leaf.get("dtype", "")),
                                               _load_file(rank_dir / "dump_tensor_data" / leaf["data_name"]), record))
    _number_occurrences(dump.tensors)
    return dump


# ---- both --------------------------------------------------------------------------------------
def is_dump(path: str | Path) -> bool:
    """Whether `path` holds tensor dumps and no statistics (a run directory with both is a run)."""
    path = Path(path)
    if not path.is_dir():
        return False
    if _msprobe_files(path):
        return True
    has_stats = any(any(path.glob(pattern)) for pattern in (
        DB_NAME, STREAM_NAME, "*.csv", f"*/{DB_NAME}", f"*/{STREAM_NAME}", "*/*.csv"))
    return bool(_trainmon_indexes(path)) and not has_stats


def read_dumps(path: str | Path) -> dict[tuple[int, int], StepDump]:
    """{(rank, step): StepDump} of a dump directory of either kind.

    Raises:
        InputError: no dump there, or a file cannot be read (naming it).
    """
    path = Path(path)
    if not path.exists():
        raise InputError.at(path, "does not exist")
    ms = _msprobe_files(path)
    dumps = [_read_msprobe(p) for p in ms] if ms else [_read_trainmon(p) for p in _trainmon_indexes(path)]
    if not dumps:
        raise InputError.at(path, "holds no tensor dump (trainmon: dumps/step<S>/index.json, written with the "
                                  "`dump` config block; msprobe: step<S>/rank<R>/dump.json with dump_tensor_data/)")
    return {(d.rank, d.step): d for d in dumps}
