"""msprobe dump directories as `nan-analyze` input: every non-finite tensor of a `dump.json` as an AnomalyEvent.

msprobe's dump.json format, as used here:
- Layout: `<dump_path>/step<N>/rank<R>/dump.json` (`proc<pid>` instead of `rank<R>` when torch.distributed
  was not initialised, plain `rank` in older versions). Accepted: a dump_path, one step directory, or one
  rank directory.
- `dump.json` is `{"task", "level", "framework", "data": {<entry>: {...}}}`, its entries in execution order.
- Entry names: `Module.<path>.<Class>.forward|backward.<n>` and `Module.<path>.<Class>.parameters_grad.<n>`
  for modules (`Cell.` in MindSpore), `<Kind>.<api>.<n>.forward|backward` for API calls
  (`Functional.linear.3`, `Tensor.__add__.0`, `Distributed.all_reduce.0`).
- A forward entry holds `input_args`, `input_kwargs`, `output` (and a module's `parameters`); a backward
  entry holds `input` (the gradients that reached the call) and `output` (the gradients it computed); a
  `parameters_grad` entry holds each parameter's gradient.
- A tensor is `{"type", "dtype", "shape", "Max", "Min", "Mean", "Norm", ...}`. NaN/Inf show in Max/Min
  (torch's max and min propagate NaN), which is where msprobe's own analysis looks for them too.

Each non-finite tensor becomes one event: rank from the rank directory, step from the step directory,
`call_index` = the entry's position in dump.json, `micro_step` None (msprobe has no micro-steps), and the
phase of the entry (`forward` or `backward`, which is when its tensors were seen, parameters and
collectives included: the ordering key puts phase before call index). Module
entries name the module path (`<path>#<n>` for its n-th extra call in the step); API entries name the call
(`Functional.linear.3`); the tensor is `input_args_<i>`, `input_kwargs_<key>`, `input_<i>` or `output_<i>`
(`_<j>` per level of nesting). Parameters and their gradients are named like trainmon's own records
(`<path>.<param>`, tensor `param` / `grad`). Distributed calls become `comm` records (msprobe_comm).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

from trainmon.core.layout import DUMP_RANK_DIR
from trainmon.core.events import AnomalyEvent
from trainmon.analysis.msprobe_comm import CommNamer, gap_notes, is_tensor, known_op
from trainmon.read.errors import InputError
from trainmon.core.collective_ops import compact_ranks
from trainmon.core.records import ACTV, ACTV_GRAD, COMM, GRAD_UNREDUCED, PARAM_ORIGIN

DUMP_FILE = "dump.json"
RULE = "msprobe"  # the `rule` of every event read from a dump
_STEP_DIR = re.compile(r"^step(\d+)$")
_MODULE_ENTRY = re.compile(r"^(?:Module|Cell)\.(?P<body>.+)\.(?P<kind>forward|backward|parameters_grad)"
                           r"\.(?P<n>\d+)$")
_API_ENTRY = re.compile(r"^(?P<call>(?P<kind>[^.]+)\.(?P<api>.+)\.\d+)\.(?P<phase>forward|backward)$")


class Place(NamedTuple):
    """Where an entry's tensors belong: the module (or call) name, its path for parameters, the phase."""

    module: str
    path: str
    phase: str
    params_grad: bool = False
    distributed_op: Optional[str] = None


class Dump(NamedTuple):
    """What `analyze` needs of a dump: run (the path), sources {rank: [files]}, notes, events."""

    run: str
    sources: dict
    notes: list
    events: list


def read_dump(path: Path) -> Optional[Dump]:
    """The events of the msprobe dump at `path`, or None when `path` is not an msprobe dump directory.

    Raises:
        InputError: a dump.json is truncated or not in msprobe's format (named in the message).
    """
    files, notes = locate(path)
    if not files:
        return None
    events, gaps, steps = [], [], {}
    for step, rank, file in files:
        found, file_gaps, blind = read_dump_json(file, step, rank)
        events += found
        gaps += file_gaps
        steps.setdefault(rank, []).append(step)
        if blind:
            notes.append(f"{file}: no Max/Min statistics (msprobe summary_mode md5 or xor_checksum, or task "
                         f"structure), so NaN/Inf cannot be seen there")
    notes += gap_notes(gaps)
    sources = {str(rank): [f"{DUMP_FILE} (step{'s' if len(steps[rank]) > 1 else ''} "
                           f"{compact_ranks(sorted(steps[rank]))})"] for rank in sorted(steps)}
    return Dump(str(path), sources, notes, events)


def locate(path: Path) -> tuple[list[tuple[int, int, Path]], list[str]]:
    """(step, rank, dump.json) of every rank of an msprobe dump at `path` (none if it is not one), and notes."""
    notes: list[str] = []
    if (path / DUMP_FILE).is_file():  # a rank directory
        step_dirs = [(path.parent, [path])]
    elif _rank_dirs(path):  # a step directory
        step_dirs = [(path, _rank_dirs(path))]
    else:  # a dump_path
        children = sorted((c for c in path.iterdir() if c.is_dir() and _STEP_DIR.match(c.name)),
                          key=lambda c: int(_STEP_DIR.match(c.name).group(1))) if path.is_dir() else []
        step_dirs = [(c, _rank_dirs(c)) for c in children]
    if not any((rank_dir / DUMP_FILE).is_file() for _, ranks in step_dirs for rank_dir in ranks):
        return [], []
    files = []
    for step_dir, ranks in step_dirs:
        match = _STEP_DIR.match(step_dir.name)
        if match is None:
            notes.append(f"{step_dir}: not a step<N> directory; its dump is reported as step 0")
        step = int(match.group(1)) if match else 0
        for rank_dir in ranks:
            rank = _rank_of(rank_dir.name, len(ranks))
            if not DUMP_RANK_DIR.match(rank_dir.name):
                notes.append(f"{rank_dir}: not a rank<R> directory; its dump is reported as rank 0")
            if not (rank_dir / DUMP_FILE).is_file():
                notes.append(f"{rank_dir}: no {DUMP_FILE} (that rank wrote nothing for step {step})")
            elif rank is None:
                notes.append(f"{rank_dir}: a proc<pid> directory beside others, its rank unknown; left out")
            else:
                files.append((step, rank, rank_dir / DUMP_FILE))
    return files, notes


def _rank_dirs(step_dir: Path) -> list[Path]:
    if not step_dir.is_dir():
        return []
    return sorted(c for c in step_dir.iterdir() if c.is_dir() and DUMP_RANK_DIR.match(c.name))


def _rank_of(name: str, siblings: int) -> Optional[int]:
    """The rank an msprobe rank directory stands for. A lone `proc<pid>` is a single-process run (rank 0),
    and so is a lone directory given directly under another name."""
    match = DUMP_RANK_DIR.match(name)
    if match is None or name.startswith("proc"):
        return 0 if siblings == 1 else None
    return int(match.group(1) or 0)


def read_dump_json(path: Path, step: int, rank: int) -> tuple[list[AnomalyEvent], list, bool]:
    """The non-finite tensors of one dump.json: (events in file order, comm gaps, whether it has tensors
    but none of them carries Max/Min statistics)."""
    data = _load(path)
    namer, events, tensors, with_stats = CommNamer(rank), [], 0, 0
    for index, (name, entry) in enumerate(data.items()):
        if not isinstance(entry, dict):
            raise InputError(f"{path}: entry {name!r} is {type(entry).__name__}, not an object; this is not "
                             f"msprobe's dump.json format")
        place = _place(name)
        for family, module, tensor, stats in _tensors_of(place, entry, namer, f"{name} (rank {rank}, step {step})"):
            value = _nonfinite(stats)
            tensors, with_stats = tensors + 1, with_stats + (value is not None)
            if value is not None and not math.isfinite(value[1]):
                events.append(AnomalyEvent(rank=rank, step=step, micro_step=None, pp_stage=0, vpp_stage=0,
                                           call_index=index, module=module,
                                           phase=place.phase,
                                           tensor=tensor, op=value[0], value=value[1], rule=RULE, family=family))
    return events, namer.gaps, tensors > 0 and not with_stats


def _load(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            document = json.load(fh)  # msprobe writes NaN and Infinity, which json reads as floats
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: not a complete JSON document ({err.msg}, line {err.lineno} column "
                         f"{err.colno}); the dump.json looks truncated or corrupt") from None
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: cannot read it ({err})") from None
    data = document.get("data") if isinstance(document, dict) else None
    if not isinstance(data, dict):
        raise InputError(f"{path}: no \"data\" object of entries; this is not msprobe's dump.json format")
    return data


def _place(name: str) -> Place:
    match = _MODULE_ENTRY.match(name)
    if match:
        path = match["body"].rpartition(".")[0].lstrip(".")  # drop the class name
        calls = int(match["n"])
        module = path if calls == 0 else f"{path}#{calls}"
        if match["kind"] == "parameters_grad":
            return Place(module, path, "backward", params_grad=True)
        return Place(module, path, match["kind"])
    match = _API_ENTRY.match(name)
    if match:
        op = known_op(match["api"]) if match["kind"] == "Distributed" else None
        return Place(match["call"], "", match["phase"], distributed_op=op)
    return Place(name, "", "unknown")


def _tensors_of(place: Place, entry: dict, namer: CommNamer, where: str) -> Iterator[tuple[str, str, str, dict]]:
    """(family, module, tensor, statistics) of every tensor of an entry."""
    if place.distributed_op is not None:
        for name, stats in namer.records(place.distributed_op, entry, where):
            yield COMM, name, COMM, stats
        return
    if place.params_grad:
        for param, value in entry.items():
            for _, stats in _walk(value, ""):
                yield GRAD_UNREDUCED, _dotted(place.path, param), "grad", stats
        return
    family = ACTV_GRAD if place.phase == "backward" else ACTV
    for part, value in entry.items():
        if part == "parameters" and isinstance(value, dict):
            for param, stats in value.items():
                if is_tensor(stats):
                    yield PARAM_ORIGIN, _dotted(place.path, param), "param", stats
            continue
        for tensor, stats in _walk(value, part):
            yield family, place.module, tensor, stats


def _walk(value, prefix: str) -> Iterator[tuple[str, dict]]:
    """(name, statistics) of the tensors nested in an argument list, dict or single value."""
    if is_tensor(value):
        yield prefix, value
    elif isinstance(value, dict) and "type" not in value:  # kwargs, or an object such as a P2POp
        for key, item in value.items():
            yield from _walk(item, f"{prefix}_{key}".lstrip("_"))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _walk(item, f"{prefix}_{i}".lstrip("_"))


def _nonfinite(stats: dict) -> Optional[tuple[str, float]]:
    """("max" or "min", value) of the first non-finite of Max/Min; ("max", finite) when both are finite;
    None when the tensor has no statistics."""
    numbers = [(key.lower(), _number(stats.get(key))) for key in ("Max", "Min")]
    numbers = [(op, v) for op, v in numbers if v is not None]
    return next(((op, v) for op, v in numbers if not math.isfinite(v)), numbers[0] if numbers else None)


def _number(value) -> Optional[float]:
    if isinstance(value, bool):  # a bool tensor's Max/Min
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # older dumps wrote "inf"/"nan" as text
        try:
            return float(value.strip())
        except ValueError:
            return None
    return None


def _dotted(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
