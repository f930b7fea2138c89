"""The checks of `config-check compare`: each pairs the packs' entries by key and lists what differs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from trainmon.config_check.pack import Pack
from trainmon.read.errors import InputError

PASS, FAIL, SKIP = "pass", "fail", "skipped"
_MISSING = "<absent>"


@dataclass
class CheckResult:
    name: str
    status: str = PASS
    differences: list[dict[str, Any]] = field(default_factory=list)
    compared: int = 0
    note: str = ""


def _keyed_rows(rows: list[dict], key: Callable[[dict], str]) -> dict[str, dict]:
    return {key(row): row for row in rows}


def _entries(check: str, members: dict) -> Optional[dict[str, tuple[Any, dict]]]:
    """{key: (compared value, row of details)} of one check in one pack; None when the pack lacks it."""
    if check == "hyperparameters":
        values = members["hyperparameters"]["compared"] if check in members else None
    elif check in ("weights", "dataset"):
        if check not in members:
            return None
        name = (lambda r: r["name"]) if check == "weights" else (lambda r: f"{r['micro_step']}/{r['name']}")
        rows = _keyed_rows(members[check], name)
        return {k: (row["sha256"], {f: row.get(f) for f in ("shape", "dtype", "norm", "mean", "min", "max")})
                for k, row in rows.items()}
    else:
        values = members.get(check)
    return None if values is None else {k: (v, {}) for k, v in values.items()}


def _compare_pair(check: str, rank: Any, a: Pack, b: Pack, result: CheckResult) -> bool:
    """Adds the differences of one pair of packs; False when either pack lacks this check."""
    left, right = _entries(check, a.members), _entries(check, b.members)
    if left is None or right is None:
        return False
    for key in sorted(set(left) | set(right)):
        (va, da), (vb, db) = left.get(key, (_MISSING, {})), right.get(key, (_MISSING, {}))
        result.compared += 1
        if va != vb:
            row = {"rank": rank, "key": key, "a": va, "b": vb}
            for detail in sorted(set(da) | set(db)):
                row[f"a_{detail}"], row[f"b_{detail}"] = da.get(detail), db.get(detail)
            result.differences.append(row)
    return True


def pair_packs(a: dict, b: dict, path_a, path_b) -> list[tuple[Any, Pack, Pack]]:
    """(rank, pack A, pack B) pairs: by rank, or the two single packs whatever their ranks."""
    if len(a) == 1 and len(b) == 1:
        (rank, pa), (_, pb) = next(iter(a.items())), next(iter(b.items()))
        return [(rank, pa, pb)]
    if set(a) != set(b):
        raise InputError(f"{path_a} has ranks {sorted(a, key=str)} but {path_b} has ranks {sorted(b, key=str)}: "
                         "compare packs of jobs with the same number of ranks")
    return [(rank, a[rank], b[rank]) for rank in sorted(a, key=str)]


CHECKS = ("environment", "packages", "hyperparameters", "weights", "dataset", "random")


def run_checks(pairs: list[tuple[Any, Pack, Pack]]) -> list[CheckResult]:
    """One result per check of CHECKS; a check that a pack did not record is skipped, never passed."""
    results = []
    for check in CHECKS:
        result = CheckResult(check)
        recorded = [_compare_pair(check, rank, a, b, result) for rank, a, b in pairs]
        if not all(recorded):
            result.status, result.differences = SKIP, []
            result.note = "not recorded in both packs (a command-line capture has no weights, data or generators)"
        elif result.differences:
            result.status = FAIL
        results.append(result)
    return results
