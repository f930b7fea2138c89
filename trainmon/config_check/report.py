"""The result of `config-check compare`: a summary table on the terminal, detail CSVs and one JSON file."""
from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TextIO

from trainmon.config_check.checks import CheckResult
from trainmon.read.errors import InputError

SHOWN_DIFFERENCES = 5


def _short(value, width: int = 40) -> str:
    text = str(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def print_summary(results: list[CheckResult], out: TextIO) -> None:
    """One line per check, then the first differences of each failed check."""
    out.write(f"{'check':<16}{'result':<9}{'compared':>9}{'differ':>8}\n")
    for r in results:
        out.write(f"{r.name:<16}{r.status:<9}{r.compared:>9}{len(r.differences):>8}  {r.note}\n".rstrip() + "\n")
    for r in results:
        if r.differences:
            out.write(f"\n{r.name}: first differences (rank, key: A -> B)\n")
            for d in r.differences[:SHOWN_DIFFERENCES]:
                rank = "-" if d["rank"] is None else d["rank"]  # a pack captured outside a job
                out.write(f"  {rank}, {d['key']}: {_short(d['a'])} -> {_short(d['b'])}\n")
            if len(r.differences) > SHOWN_DIFFERENCES:
                out.write(f"  ... {len(r.differences) - SHOWN_DIFFERENCES} more\n")


def output_files(directory: Path, results: list[CheckResult]) -> list[Path]:
    return [directory / f"{r.name}.csv" for r in results] + [directory / "result.json"]


def prepare_directory(directory: Path, overwrite: bool) -> None:
    """Creates the output directory; an existing one is an error unless `overwrite` (then only our own files
    in it are replaced, nothing else is touched)."""
    if directory.exists() and not overwrite:
        raise InputError.at(directory, "the output directory exists; give --overwrite to replace its result files")
    if directory.exists() and not directory.is_dir():
        raise InputError.at(directory, "exists and is not a directory")
    directory.mkdir(parents=True, exist_ok=True)


def write_details(directory: Path, results: list[CheckResult], packs: dict) -> None:
    """`<check>.csv` with every difference of that check, and `result.json` with everything."""
    for r in results:
        columns = ["rank", "key", "a", "b"] + sorted({k for d in r.differences for k in d} - {"rank", "key", "a", "b"})
        with open(directory / f"{r.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(r.differences)
    with open(directory / "result.json", "w") as f:
        json.dump(result_summary(results, packs), f, indent=1, default=str)


def result_summary(results: list[CheckResult], packs: dict) -> dict:
    """Everything about a comparison, as `result.json` and `--json` give it."""
    return {"packs": packs, "passed": all(r.status != "fail" for r in results),
            "checks": {r.name: {"status": r.status, "compared": r.compared, "note": r.note,
                                "differences": r.differences} for r in results}}
