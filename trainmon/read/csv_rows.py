"""Reading one family CSV (trainmon's or msprobe's columns): its rows, typed, or an error naming the line."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Iterator

from trainmon.read.errors import InputError

INDEX_COLUMNS = ("vpp_stage", "name", "step", "micro_step")
KEY_COLUMNS = ("shape", "dtype")
_REQUIRED = ("vpp_stage", "name", "step")


def read_csv_rows(path: Path) -> tuple[list[str], Iterator[dict]]:
    """(op columns, rows) of one family CSV. A row maps the index columns to int/str, each op to a
    float (NaN when the file says nan) or None (empty cell: no value), shape to a list when the file
    gives one, dtype to str.

    Raises (the rows raise as they are read):
        InputError: the file has no header or lacks `vpp_stage`, `name` or `step`; a row has the wrong
            number of cells (a truncated file) or a figure that is not a number.
    """
    handle = open(path, newline="", encoding="utf-8")
    reader = csv.reader(handle)
    try:
        header = next(reader, None)
    except (csv.Error, UnicodeDecodeError) as err:
        handle.close()
        raise InputError.at(path, f"not a monitor CSV ({err})", 1) from None
    missing = [c for c in _REQUIRED if c not in (header or [])]
    if missing:
        handle.close()
        raise InputError.at(path, f"not a trainmon CSV header (needs {list(_REQUIRED)}, got {header}; "
                                  f"missing {missing})", 1)
    ops = [c for c in header if c not in INDEX_COLUMNS and c not in KEY_COLUMNS]

    def rows() -> Iterator[dict]:
        with handle:
            line = 1
            try:
                for line, cells in enumerate(reader, start=2):
                    if len(cells) != len(header):
                        raise InputError.at(path, f"{len(cells)} fields where the header has {len(header)} "
                                                  "(the file is truncated or corrupt)", line)
                    yield _typed(dict(zip(header, cells)), ops)
            except ValueError as err:
                if isinstance(err, InputError):
                    raise
                raise InputError.at(path, f"not a number where one is expected ({err})", line) from None
            except (csv.Error, UnicodeDecodeError) as err:
                raise InputError.at(path, f"not CSV ({err})", line + 1) from None

    return ops, rows()


def _typed(row: dict, ops: list[str]) -> dict:
    micro = row.get("micro_step", "")
    shape = row.get("shape", "")
    out = {"vpp_stage": int(row["vpp_stage"]), "name": row["name"], "step": int(row["step"]),
           "micro_step": int(micro) if micro != "" else None,
           "shape": json.loads(shape) if shape.startswith("[") else shape, "dtype": row.get("dtype", "")}
    out.update({op: float(row[op]) if row[op] != "" else None for op in ops})
    return out
