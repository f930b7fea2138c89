"""`trainmon export`: every record of a run as a Hive-partitioned Parquet dataset, for engines that go past
one machine (DuckDB, pandas, Spark).

Layout: `<out>/family=<family>/rank=<rank>/part-0.parquet`. Columns: step, micro_step, vpp_stage,
pp_stage, call_index, name, module, phase, tensor, shape, dtype, the record's fields `raw_count` ...
`raw_sat` (from a database) and the figures (`norm`, `min`, ...), `nonfinite` (the record held a NaN or
an Inf), and the ordering key as `order_*` columns: sorting by them and then rank is the order
`nan-analyze` uses. NaN and ±Inf values are kept; a value the source lacks is null.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np

from trainmon.core.events import phase_of, split_name
from trainmon.core.ordering import stage_place
from trainmon.read.database import DbRankReader
from trainmon.read.layout import RankDir, find_run
from trainmon.read.parallel import map_ranks
from trainmon.read.rank_records import open_rank

# The ordering key's parts, in order (ordering.order_key); the rank, its last part, is a partition column.
ORDER_COLUMNS = ("order_step", "order_micro_step", "order_phase", "order_vpp", "order_pp", "order_call_index")
PART_FILE = "part-0.parquet"


PARTITION_DIR = re.compile(r"^family=")  # what --overwrite replaces


def check_pyarrow() -> None:
    """Raises ImportError, saying how to install it, when pyarrow is missing."""
    _pyarrow()


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as err:
        raise ImportError("trainmon export needs pyarrow: pip install 'trainmon[parquet]'") from err
    return pyarrow


def _rank_columns(reader) -> tuple[dict, dict]:
    """(columns as numpy arrays, the rows without a value per figure) of one rank's records: from a
    database by one columnar read (`DbRankReader.columns`), from CSV files row by row."""
    if isinstance(reader, DbRankReader):
        columns = reader.columns(None, None, None)
        data, missing = columns.data, columns.missing
    else:
        rows = [row for _, step_rows in reader.rows(None, None, None) for row in step_rows]
        data = {name: [row.get(name) for row in rows] for name in dict.fromkeys(k for r in rows for k in r)}
        missing = {}
    return {name: _array(values) for name, values in data.items()}, missing


def _array(values) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _floats(values: np.ndarray) -> np.ndarray:
    """As float64, None as NaN."""
    return values.astype(np.float64) if values.dtype != object else np.array(
        [math.nan if v is None else v for v in values], dtype=np.float64)


def _per_key(keys: list[tuple], derive) -> list:
    """`derive(*key)` of every row, computed once per distinct key (few, against many records)."""
    done = {}
    return [done[key] if key in done else done.setdefault(key, derive(*key)) for key in keys]


def _record_columns(data: dict, pp_stage: int) -> dict:
    """The dataset's own columns (see the module docstring) of one rank's records, in their order."""
    count = len(data["step"])
    none = _array([None] * count)
    places = _per_key(list(zip(data["family"], data["name"])),
                      lambda family, name: (*split_name(family, name), phase_of(family)))
    module, tensor, phase = (_array([place[i] for place in places]) for i in range(3))
    micro, call = data["micro_step"], data.get("call_index", none)
    pp = data.get("pp_stage", np.full(count, pp_stage, dtype=np.int64))
    out = {"step": data["step"], "micro_step": micro, "vpp_stage": data["vpp_stage"], "pp_stage": pp,
           "call_index": call, "name": data["name"], "module": module, "phase": phase, "tensor": tensor,
           "shape": _array([str(shape) for shape in data["shape"]]), "dtype": data["dtype"]}
    # the ordering key's stage part, from `ordering` itself, once per (phase, vpp_stage, pp_stage)
    stage = np.array(_per_key(list(zip(phase, data["vpp_stage"], pp)), lambda phase, vpp, pp: stage_place(
        SimpleNamespace(step=0, micro_step=0, phase=phase, vpp_stage=vpp, pp_stage=pp))[2:]),
        dtype=np.float64).reshape(-1, 3)
    last = [np.nan_to_num(_floats(v), nan=math.inf) for v in (micro, call)]  # missing sorts last
    out.update(zip(ORDER_COLUMNS, (data["step"].astype(np.float64), last[0], *stage.T, last[1])))
    nans, infs = (np.nan_to_num(_floats(data.get(f"raw_{f}", data.get(f, none))), nan=0.0) for f in ("nans", "infs"))
    out["nonfinite"] = (nans > 0) | (infs > 0)
    return out


def export_rank(job: tuple) -> int:
    """Writes one rank's records (job: rank directory, output directory); returns how many."""
    rank_dir, out = job
    pa = _pyarrow()
    reader = open_rank(rank_dir)
    pp_stage = reader.meta.get("pp_stage", 0) if isinstance(reader.meta.get("pp_stage", 0), int) else 0
    try:
        data, missing = _rank_columns(reader)
    finally:
        reader.close()
    if not len(data.get("step", ())):
        return 0
    own = _record_columns(data, pp_stage)
    columns = {**own, **{k: v for k, v in data.items() if k not in own and k not in ("family", "nan_fields")}}
    # one type per column in every file (a column of nulls would otherwise be typed null), so that
    # readers that take the schema from one file (pandas, Spark) read them all
    types = {**dict.fromkeys(_INTS, pa.int64()), **dict.fromkeys(_STRINGS, pa.string()), "nonfinite": pa.bool_()}
    for family in dict.fromkeys(data["family"]):
        rows = np.flatnonzero(data["family"] == family)
        table = pa.table({k: pa.array(v[rows], type=types.get(k, pa.float64()),
                                      mask=missing[k][rows] if k in missing else None) for k, v in columns.items()})
        target = Path(out) / f"family={family}" / f"rank={rank_dir.rank}"
        target.mkdir(parents=True, exist_ok=True)
        pa.parquet.write_table(table, target / PART_FILE)
    return len(data["step"])


# The other columns (the figures, the raw fields, the ordering key) are float64.
_INTS = ("step", "micro_step", "vpp_stage", "pp_stage", "call_index")
_STRINGS = ("name", "module", "phase", "tensor", "shape", "dtype")


def export(src: str | Path, out: str | Path, progress: bool = False, ranks: Optional[Sequence[int]] = None) -> int:
    """Writes the dataset of the run at `src` (of `ranks` only, when given) into `out` (see the module
    docstring); returns the records written.

    Raises:
        InputError: bad input, named by file and line; one of `ranks` is not in the run.
        ImportError: pyarrow is not installed.
    """
    check_pyarrow()
    run = find_run(src)
    jobs: list[tuple[RankDir, Path]] = [(rank_dir, Path(out)) for rank_dir in run.only(ranks)]
    return sum(map_ranks(export_rank, jobs, progress, "export"))

