"""Tensor by tensor: two dumps aligned by rank, step, micro-step, module, phase, role and call count.

Per tensor pair (in fp32 accumulation; fp64 stays fp64): cosine similarity, RMSE, max absolute error,
max relative error (|a - b| / max(|a|, |b|)), and the fraction of elements within
`atol + rtol * |a|`. Elements that are finite in one tensor and not in the other are counted
(`nonfinite_mismatch`) and make the pair diverge; the figures are over the elements finite in both.
A pair diverges when cosine < `cosine` and max abs error > `max_abs` (msprobe's 0.99 and 0.001). The
first divergent pair in A's call order is reported with its module's call stack and both statistic
records, as msprobe's "parse" does.
"""
from __future__ import annotations

import argparse
import csv
from typing import Optional, TextIO

import torch

from trainmon.compare.dumps import DumpTensor, StepDump, is_dump, read_dumps
from trainmon.compare.thresholds import DEFAULT_COSINE, DEFAULT_MAX_ABS
from trainmon.read.errors import InputError

COLUMNS = ("rank", "step", "micro_step", "order", "module", "phase", "role", "shape_a", "shape_b", "cosine", "rmse",
           "max_abs", "max_rel", "within_tolerance", "nonfinite_mismatch", "verdict")

__all__ = ["DEFAULT_COSINE", "DEFAULT_MAX_ABS", "compare_command", "compare_tensors", "is_dump"]


def compare_tensors(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> dict:
    """The figures of one pair of tensors of the same shape."""
    acc = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    x, y = a.detach().reshape(-1).to(acc), b.detach().reshape(-1).to(acc)
    fx, fy = torch.isfinite(x), torch.isfinite(y)
    mismatch = int((fx != fy).sum())
    both = fx & fy
    x, y = x[both], y[both]
    diff = (x - y).abs()
    nx, ny = torch.linalg.vector_norm(x), torch.linalg.vector_norm(y)
    if nx == 0 and ny == 0:
        cosine = 1.0
    elif nx == 0 or ny == 0:
        cosine = 0.0
    else:
        # rounding can take it just past 1 (1.0000001 for identical tensors): a cosine lies in [-1, 1]
        cosine = min(1.0, max(-1.0, float(torch.dot(x, y) / (nx * ny))))
    scale = torch.maximum(x.abs(), y.abs())
    rel = torch.where(scale > 0, diff / scale.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(diff))
    n = diff.numel()
    return {"cosine": cosine, "rmse": float(diff.square().mean().sqrt()) if n else 0.0,
            "max_abs": float(diff.max()) if n else 0.0, "max_rel": float(rel.max()) if n else 0.0,
            "within_tolerance": float((diff <= atol + rtol * x.abs()).float().mean()) if n else 1.0,
            "nonfinite_mismatch": mismatch}


def _pair(ta: Optional[DumpTensor], tb: Optional[DumpTensor], rtol: float, atol: float, cosine: float,
          max_abs: float) -> dict:
    where = ta or tb
    row = {"micro_step": where.micro_step, "order": where.order, "module": where.module, "phase": where.phase,
           "role": where.role, "shape_a": None if ta is None else list(ta.shape),
           "shape_b": None if tb is None else list(tb.shape)}
    if ta is None or tb is None:
        return {**row, "verdict": "only_b" if ta is None else "only_a"}
    if ta.load is None or tb.load is None:
        return {**row, "verdict": "not stored (cut by the size cap)"}
    a, b = ta.load(), tb.load()
    if a.shape != b.shape:
        return {**row, "verdict": "shapes differ"}
    if not (a.is_floating_point() and b.is_floating_point()):
        return {**row, "verdict": "equal" if torch.equal(a, b) else "diverged"}
    figures = compare_tensors(a, b, rtol, atol)
    bad = figures["nonfinite_mismatch"] > 0 or (figures["cosine"] < cosine and figures["max_abs"] > max_abs)
    return {**row, **figures, "verdict": "diverged" if bad else "match"}


def compare_step(a: StepDump, b: StepDump, rtol: float, atol: float, cosine: float, max_abs: float) -> list[dict]:
    """One row per tensor of either dump, in A's call order (B's extra tensors after)."""
    by_key = {t.key: t for t in b.tensors}
    keys_a = {t.key for t in a.tensors}
    rows = [_pair(t, by_key.get(t.key), rtol, atol, cosine, max_abs) for t in a.tensors]
    rows += [_pair(None, t, rtol, atol, cosine, max_abs) for t in b.tensors if t.key not in keys_a]
    for row in rows:
        row.update(rank=a.rank, step=a.step)
    return rows


def compare_dumps(path_a: str, path_b: str, ranks: Optional[list[int]], steps, rtol: float, atol: float,
                  cosine: float, max_abs: float) -> tuple[list[dict], dict]:
    """(rows, summary) of two dump directories, rank by rank (only `ranks`, and steps `steps` = (first,
    last), either end None when open, when given).

    Raises:
        InputError: a side is not a dump, or the dumps have different rank counts.
    """
    dumps_a, dumps_b = read_dumps(path_a), read_dumps(path_b)
    ranks_a, ranks_b = sorted({r for r, _ in dumps_a}), sorted({r for r, _ in dumps_b})
    if ranks is None and ranks_a != ranks_b:
        raise InputError(f"the dumps have different ranks: {path_a} has {len(ranks_a)} ({ranks_a}), {path_b} has "
                         f"{len(ranks_b)} ({ranks_b}); dumps are compared rank by rank: pick one with --rank R")
    first_step, last_step = steps if steps is not None else (None, None)
    pairs = sorted(k for k in dumps_a if k in dumps_b and (ranks is None or k[0] in ranks)
                   and (first_step is None or k[1] >= first_step) and (last_step is None or k[1] <= last_step))
    if not pairs:
        raise InputError(f"no (rank, step) is in both dumps: {path_a} has {sorted(dumps_a)}, {path_b} has "
                         f"{sorted(dumps_b)}")
    rows, first = [], None
    # step by step, then rank by rank: an earlier step's divergence is the cause of a later one's
    for key in sorted(pairs, key=lambda k: (k[1], k[0])):
        step_rows = compare_step(dumps_a[key], dumps_b[key], rtol, atol, cosine, max_abs)
        rows += step_rows
        if first is None:
            hit = next((r for r in step_rows if r["verdict"] == "diverged"), None)
            if hit is not None:
                first = _details(hit, dumps_a[key], dumps_b[key])
    one_side = sum(r["verdict"] in ("only_a", "only_b") for r in rows)
    diverged = sum(r["verdict"] == "diverged" for r in rows)
    summary = {"a": str(path_a), "b": str(path_b), "pairs": [list(k) for k in pairs], "tensors": len(rows),
               "compared": len(rows) - one_side, "one_side_only": one_side, "diverged": diverged,
               "agree": diverged == 0 and one_side == 0 and all(r["verdict"] in ("match", "equal") for r in rows),
               "thresholds":
               {"cosine": cosine, "max_abs": max_abs, "rtol": rtol, "atol": atol}, "first_divergent": first}
    return rows, summary


def _record(dump: StepDump, row: dict) -> Optional[dict]:
    return next((t.record for t in dump.tensors if (t.module, t.phase, t.role, t.order) ==
                 (row["module"], row["phase"], row["role"], row["order"])), None)


def _details(row: dict, a: StepDump, b: StepDump) -> dict:
    """The first divergent tensor with its module's stack and both statistic records ("parse")."""
    return {**row, "stack": a.stacks.get(row["module"]) or b.stacks.get(row["module"]) or [],
            "record_a": _record(a, row), "record_b": _record(b, row)}


def format_report(summary: dict) -> str:
    t = summary["thresholds"]
    lines = [f"compared {summary['compared']} tensors both dumps hold, of (rank, step) {summary['pairs']}: "
             f"{summary['diverged']} diverged (cosine < {t['cosine']} and max abs error > {t['max_abs']}); "
             f"{summary['one_side_only']} exist in one dump only",
             f"  A: {summary['a']}", f"  B: {summary['b']}"]
    first = summary["first_divergent"]
    if first is None:
        lines.append("the dumps agree: every tensor exists in both and matches" if summary["agree"] else
                     "no divergent tensor, but the dumps differ: see the tensors in one dump only or not compared "
                     "(-o writes each tensor's verdict)")
        return "\n".join(lines)
    micro = "" if first["micro_step"] is None else f", micro-step {first['micro_step']}"
    lines += ["", f"first divergent tensor: {first['module']} {first['phase']} {first['role']} "
                  f"(rank {first['rank']}, step {first['step']}{micro}, call {first['order']})",
              f"  cosine {first.get('cosine')}, RMSE {first.get('rmse')}, max abs {first.get('max_abs')}, "
              f"max rel {first.get('max_rel')}, within tolerance {first.get('within_tolerance')}",
              f"  statistics A: {first['record_a']}", f"  statistics B: {first['record_b']}",
              "  stack of its first call:"]
    lines += [f"    {line.rstrip()}" for frame in first["stack"] for line in str(frame).splitlines()]
    return "\n".join(lines)


def write_csv(rows: list[dict], out: TextIO) -> None:
    writer = csv.writer(out)
    writer.writerow(COLUMNS)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row.get(c) for c in COLUMNS])


def compare_command(args: argparse.Namespace):
    """(summary, write rows, text) for `trainmon compare` on two dumps."""
    for path in (args.a, args.b):
        if not is_dump(path):
            raise InputError(f"{path}: not a tensor dump, while the other side is one: compare two dumps or two runs")
    rows, summary = compare_dumps(args.a, args.b, args.ranks, args.steps, args.rtol, args.atol, args.cosine,
                                  args.max_abs)
    return summary, lambda fh: write_csv(rows, fh), lambda: format_report(summary)
