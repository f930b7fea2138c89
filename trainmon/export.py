"""`trainmon export`: every record of a run as a Hive-partitioned Parquet dataset, for engines that go past
one machine (DuckDB, pandas, Spark).

Layout: `<out>/family=<family>/rank=<rank>/part-0.parquet`. Columns: step, micro_step, vpp_stage,
pp_stage, call_index, name, module, phase, tensor, shape, dtype, the record's fields `raw_count` ...
`raw_sat` (from a database) and the figures (`norm`, `min`, ...), `nonfinite` (the record held a NaN or
an Inf), and the ordering key as `order_*` columns: sorting by them and then rank is the order
`nan-analyze` uses. NaN and ±Inf values are kept; a value the source lacks is null.
"""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from trainmon.anomaly.events import phase_of, split_name
from trainmon.anomaly.ordering import order_key
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


def _row(rank: int, pp_stage: int, row: dict) -> dict:
    module, tensor = split_name(row["family"], row["name"])
    out = {"step": row["step"], "micro_step": row["micro_step"], "vpp_stage": row["vpp_stage"],
           "pp_stage": row.get("pp_stage", pp_stage), "call_index": row.get("call_index"), "name": row["name"],
           "module": module, "phase": phase_of(row["family"]), "tensor": tensor,
           "shape": str(row["shape"]), "dtype": row["dtype"]}
    key = order_key(SimpleNamespace(rank=rank, **{k: out[k] for k in ("step", "micro_step", "phase", "vpp_stage",
                                                                         "pp_stage", "call_index")}))
    out.update(zip(ORDER_COLUMNS, key))
    return out


def export_rank(job: tuple) -> int:
    """Writes one rank's records (job: rank directory, output directory); returns how many."""
    rank_dir, out = job
    pa = _pyarrow()
    reader = open_rank(rank_dir)
    pp_stage = reader.meta.get("pp_stage", 0) if isinstance(reader.meta.get("pp_stage", 0), int) else 0
    by_family: dict[str, list[dict]] = {}
    try:
        for _, rows in reader.rows(None, None, None):
            for row in rows:
                record = _row(rank_dir.rank, pp_stage, row)
                values = {k: v for k, v in row.items() if k not in record and k not in ("family", "nan_fields")}
                nans, infs = row.get("raw_nans", row.get("nans")), row.get("raw_infs", row.get("infs"))
                record["nonfinite"] = bool((nans or 0) > 0 or (infs or 0) > 0)  # NaN/None compare False
                by_family.setdefault(row["family"], []).append({**record, **values})
    finally:
        reader.close()
    count = 0
    for family, records in by_family.items():
        target = Path(out) / f"family={family}" / f"rank={rank_dir.rank}"
        target.mkdir(parents=True, exist_ok=True)
        names = list(dict.fromkeys(k for r in records for k in r))  # every column, in first-seen order
        # one type per column in every file (a column of nulls would otherwise be typed null), so that
        # readers that take the schema from one file (pandas, Spark) read them all
        types = {**dict.fromkeys(_INTS, pa.int64()), **dict.fromkeys(_STRINGS, pa.string()), "nonfinite": pa.bool_()}
        table = pa.table({k: pa.array([r.get(k) for r in records], type=types.get(k, pa.float64())) for k in names})
        pa.parquet.write_table(table, target / PART_FILE)
        count += len(records)
    return count


# The other columns (the figures, the raw fields, the ordering key) are float64.
_INTS = ("step", "micro_step", "vpp_stage", "pp_stage", "call_index")
_STRINGS = ("name", "module", "phase", "tensor", "shape", "dtype")


def export(src: str | Path, out: str | Path, progress: bool = False) -> int:
    """Writes the dataset of the run at `src` into `out` (see the module docstring); returns the records written.

    Raises:
        InputError: bad input, named by file and line.
        ImportError: pyarrow is not installed.
    """
    check_pyarrow()
    run = find_run(src)
    jobs: list[tuple[RankDir, Path]] = [(rank_dir, Path(out)) for rank_dir in run.ranks]
    return sum(map_ranks(export_rank, jobs, progress, "export"))

