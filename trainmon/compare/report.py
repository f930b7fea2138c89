"""The result of a record comparison: a summary (first divergence, the worst ones), a CSV table, a text report."""
from __future__ import annotations

import csv
import math
from collections import Counter
from typing import Optional, Sequence, TextIO

from trainmon.compare.records import CLOSE, DIVERGED, EQUAL, ONLY_A, ONLY_B, Aligned
from trainmon.core.schema import OPS

VERDICTS = (EQUAL, CLOSE, DIVERGED, ONLY_A, ONLY_B)
_KEY_COLUMNS = ("family", "name", "step", "micro_step", "rank", "phase", "vpp_stage", "pp_stage", "call_index")


def _json_number(value: Optional[float]):
    """A float for JSON output: inf and NaN as strings, so the output stays valid JSON."""
    if value is None or math.isfinite(value):
        return value
    return str(value)


def describe(record: Aligned) -> dict:
    """One record as a JSON object: where it is, the verdict, and per op both figures and their differences."""
    ops = {}
    for op in OPS:
        a = None if record.a is None else record.a.get(op)
        b = None if record.b is None else record.b.get(op)
        if a is None and b is None:
            continue
        diff = record.diffs.get(op, (None, None))
        ops[op] = {"a": _json_number(a), "b": _json_number(b), "abs": _json_number(diff[0]),
                   "rel": _json_number(diff[1])}
    return {**{c: getattr(record, c) for c in _KEY_COLUMNS}, "verdict": record.verdict,
            "max_rel": _json_number(record.worst), "ops": ops}


def summarize(records: list[Aligned], run_a: str, run_b: str, ranks: list[int], rtol: float, atol: float,
              top: int = 10, unread: Sequence[str] = ()) -> dict:
    """The comparison's summary; `records` in execution order. `unread`: the runs of which a part could not be
    read (a corrupt record stream): then they are not said to agree."""
    counts = Counter(r.verdict for r in records)
    diverged = [r for r in records if r.verdict == DIVERGED]
    worst = sorted(diverged, key=lambda r: -r.worst)[:top]
    first = diverged[0] if diverged else None
    verdicts = {v: counts.get(v, 0) for v in VERDICTS}
    compared = verdicts[EQUAL] + verdicts[CLOSE] + verdicts[DIVERGED]
    one_side = verdicts[ONLY_A] + verdicts[ONLY_B]
    return {"run_a": run_a, "run_b": run_b, "ranks": ranks, "rtol": rtol, "atol": atol,
            "records": len(records), "compared": compared, "one_side_only": one_side,
            "verdicts": verdicts,
            # agreement is claimed only when every record exists on both sides and agrees
            "agree": bool(records) and verdicts[DIVERGED] == 0 and one_side == 0 and not unread,
            "unread": list(unread),
            "first_divergent": describe(first) if first else None,
            "most_divergent": [describe(r) for r in worst]}


def write_csv(records: list[Aligned], out: TextIO) -> None:
    """One row per aligned record, in execution order: where, verdict, then per op a, b, abs, rel."""
    ops = [op for op in OPS if any(op in (r.a or {}) or op in (r.b or {}) for r in records)]
    writer = csv.writer(out)
    writer.writerow(list(_KEY_COLUMNS) + ["verdict", "max_rel"] +
                    [f"{op}_{part}" for op in ops for part in ("a", "b", "abs", "rel")])
    for r in records:
        row = [getattr(r, c) for c in _KEY_COLUMNS] + [r.verdict, r.worst]
        for op in ops:
            diff = r.diffs.get(op, (None, None))
            row += [None if r.a is None else r.a.get(op), None if r.b is None else r.b.get(op), *diff]
        writer.writerow(["" if v is None else repr(v) if isinstance(v, float) else v for v in row])


def _where(d: dict) -> str:
    micro = "" if d["micro_step"] is None else f", micro-step {d['micro_step']}"
    return f"{d['family']} {d['name'] or '(root)'}, step {d['step']}{micro}, {d['phase']}, rank {d['rank']}"


def _figures(d: dict) -> list[str]:
    return [f"    {op:6} A {v['a']!s:>24}  B {v['b']!s:>24}  abs {v['abs']!s:>12}  rel {v['rel']!s:>12}"
            for op, v in d["ops"].items()]


def format_report(summary: dict) -> str:
    v = summary["verdicts"]
    lines = [f"compared {summary['compared']} records both runs hold, of rank(s) "
             f"{', '.join(map(str, summary['ranks']))}: {v[EQUAL]} equal, {v[CLOSE]} within tolerance "
             f"(rtol {summary['rtol']:g}, atol {summary['atol']:g}), {v[DIVERGED]} diverged; "
             f"{summary['one_side_only']} exist on one side only ({v[ONLY_A]} only in A, {v[ONLY_B]} only in B)",
             f"  A: {summary['run_a']}", f"  B: {summary['run_b']}"]
    first = summary["first_divergent"]
    if summary["agree"]:
        lines.append("the runs agree within tolerance: every record exists in both and agrees")
    elif first is None and summary["unread"]:
        lines.append(f"cannot say whether the runs agree: part of {' and '.join(summary['unread'])} could not be "
                     "read (see the warnings)")
    elif first is None:
        share = summary["one_side_only"] / summary["records"] if summary["records"] else 0.0
        lines.append(f"the runs differ: no record both hold diverges, but {summary['one_side_only']} of "
                     f"{summary['records']} records ({share:.0%}) exist in one run only")
    if first is None:
        return "\n".join(lines)
    lines += ["", f"first divergent record: {_where(first)}"] + _figures(first)
    lines += ["", "most divergent records (largest relative difference):"]
    for d in summary["most_divergent"]:
        lines.append(f"  {_where(d)}: max rel {d['max_rel']}")
    return "\n".join(lines)
