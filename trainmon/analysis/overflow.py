"""Which module overflowed first, and did it compute the overflow or inherit it?

A record is *bad* when it holds saturated elements (`sat`: at or beyond the dtype's largest finite
value, or `sat_threshold`), Infs or NaNs. The earliest bad record of a run, by the ordering key, and
the modules after it in the same micro-step are classified:
- *computed here*: a module's output is bad while its inputs are clean;
- *inherited*: an input was already bad, from an upstream module or, at the model's input, from the data;
- *internal*: every forward input and output is clean and the first bad value is a gradient or a later
  value (optimizer state): the overflow happened inside a computation the records do not show (a sum
  before an average, a loss scale too high).
Loss-scale scalars (`loss_scale`, `amp_skipped_steps`, `amp_updates`, written by the monitor when a
loss scaler is reachable) give the rate of skipped steps.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from trainmon.core.events import split_name
from trainmon.core.ordering import order_key
from trainmon.core.records import ACTV, PHASES
from trainmon.read import Run, coverage, find_run

COMPUTED, INHERITED, INTERNAL = "computed here", "inherited", "internal"
FROM_DATA = "data"
# Scalars the monitor writes per step when a loss scaler is reachable (trainmon.hooks.loss_scale).
LOSS_SCALE, SKIPPED, UPDATES = "loss_scale", "amp_skipped_steps", "amp_updates"
_LISTED = 8  # modules listed after the first


class _Row:
    """A record row with the attributes the ordering key reads."""

    def __init__(self, row: dict, rank: int):
        self.__dict__.update(row)
        self.rank = rank
        self.phase = PHASES.get(row["family"], "unknown")
        self.module, self.tensor = split_name(row["family"], row["name"])
        self.vpp_stage = row.get("vpp_stage") or 0
        self.pp_stage = row.get("pp_stage") or 0
        self.call_index = row.get("call_index")

    def what(self) -> Optional[str]:
        """"saturated (sat=3)", "+Inf (infs=2)", "NaN (nans=1)" joined, or None for a clean record."""
        parts = [f"{label} ({op}={int(getattr(self, op))})" for op, label in
                 (("sat", "saturated"), ("infs", self._inf_label()), ("nans", "NaN"))
                 if (getattr(self, op, None) or 0) > 0]
        return ", ".join(parts) or None

    def _inf_label(self) -> str:
        """"+Inf", "-Inf" or "+Inf/-Inf" (the sentinel's wording) from the min and max figures, which hold the
        infinities (schema); "Inf" where they do not tell: not among the ops, or NaN with a NaN element."""
        low, high = getattr(self, "min", None), getattr(self, "max", None)
        if low is None or high is None or low != low or high != high:
            return "Inf"
        neg, pos = low == -math.inf, high == math.inf
        return "+Inf/-Inf" if neg and pos else "-Inf" if neg else "+Inf"


def _first_bad_step(run: Run, rank: int, steps) -> Optional[list[_Row]]:
    """The rows of `rank`'s first step holding a bad record, or None."""
    for _, rows in run.iter_steps(rank, steps=steps):
        wrapped = [_Row(r, rank) for r in rows]
        if any(r.what() for r in wrapped):
            return sorted(wrapped, key=order_key)
    return None


def _entry(row: _Row, kind: str, origin: str, hint: str) -> dict:
    return {"class": kind, "origin": origin, "module": row.module, "tensor": row.tensor, "family": row.family,
            "phase": row.phase, "rank": row.rank, "step": row.step, "micro_step": row.micro_step,
            "call_index": row.call_index, "what": row.what(), "next": hint}


def _bad_child(module: str, bad_modules: list[str]) -> Optional[str]:
    """A module inside `module` that was bad before it (a container's output carries its children's)."""
    return next((m for m in bad_modules if m != module and (module == "" or m.startswith(module + "."))), None)


def classify(rows: list[_Row]) -> list[dict]:
    """The first bad module of one step's rows (in execution order) and the bad modules after it."""
    first = next(r for r in rows if r.what())
    if first.family != ACTV:
        return [_entry(first, INTERNAL, first.module,
                       f"forward inputs and outputs were clean; the first bad value is {first.module or '(root)'}'s "
                       f"{first.tensor} in {first.phase}: the overflow is inside a computation (a sum before an "
                       "average, a loss scale too high): compute it in fp32 or lower the loss scale, and dump step "
                       f"{first.step} (config `dump`) to see its tensors")]
    out = []
    bad_modules: list[str] = []
    for row in rows:
        if row.family != ACTV or row.micro_step != first.micro_step or not row.what():
            continue
        if row.tensor.startswith("input"):
            if not bad_modules:  # nothing before it was bad: the batch brought it
                out.append(_entry(row, INHERITED, FROM_DATA,
                                  f"the batch of step {row.step} already held {row.what()} at "
                                  f"{row.module or '(root)'}'s input: check the data pipeline for that batch"))
            bad_modules.append(row.module)
        elif row.module not in bad_modules and (inner := _bad_child(row.module, bad_modules)) is not None:
            out.append(_entry(row, INHERITED, inner, f"a module inside it, {inner}, was bad first: see there"))
            bad_modules.append(row.module)
        elif row.module not in bad_modules:  # output bad, inputs clean
            out.append(_entry(row, COMPUTED, row.module,
                              f"{row.module or '(root)'} made {row.what()} from clean inputs: run it in fp32 (or "
                              "bf16, which has fp32's range), or bound its inputs and weights (a norm before it, a "
                              "smaller init or learning rate)"))
            bad_modules.append(row.module)
        elif not any(e["module"] == row.module for e in out):
            upstream = next((m for m in bad_modules if m != row.module), "the data")
            out.append(_entry(row, INHERITED, upstream,
                              f"its input was already bad: fix {upstream or '(root)'} first"))
        if len(out) > _LISTED:
            break
    return out


def loss_scale_summary(run: Run) -> Optional[dict]:
    """Skipped steps and the last loss scale, from the loss-scale scalars (None when there are none)."""
    scalars = run.scalars()
    if scalars.empty or not scalars["name"].isin([SKIPPED, UPDATES]).any():
        return None
    last = scalars.sort_values("step").groupby(["rank", "name"]).last()["value"]
    rank = int(scalars["rank"].min())
    skipped, updates = last.get((rank, SKIPPED)), last.get((rank, UPDATES))
    skipped_at = scalars[(scalars["name"] == SKIPPED) & (scalars["rank"] == rank)].sort_values("step")
    steps = skipped_at["step"][skipped_at["value"].diff().fillna(skipped_at["value"]) > 0].tolist()
    return {"rank": rank, "skipped": skipped, "updates": updates, "loss_scale": last.get((rank, LOSS_SCALE)),
            "rate": skipped / updates if updates else None, "steps_with_skips": [int(s) for s in steps]}


def analyze(path: str | Path, steps=None, ranks=None) -> dict:
    """The overflow report of a run (of `ranks` only, when given): the first bad module, classified, the
    loss-scale summary, and the ranks of the run without output (`missing_ranks`; none when `ranks` are given,
    since they are all there).

    Raises:
        InputError: bad input, one of `ranks` is not in the run, or no record to judge: `steps` outside the run,
            or none collected.
    """
    with Run(path) as run:
        chosen = [d.rank for d in find_run(run.path).only(ranks)]
        coverage.check_steps(run, chosen, steps)
        firsts = [rows for rank in chosen if (rows := _first_bad_step(run, rank, steps))]
        if not firsts:
            coverage.require_records(run, chosen, steps)
        ops = sorted({op for rank in run.ranks for op in run.ops(rank)})
        chain = []
        if firsts:
            earliest = min(firsts, key=lambda rows: order_key(next(r for r in rows if r.what())))
            chain = classify(earliest)
        return {"run": str(run.path), "saturation_counted": "sat" in ops, "modules": chain,
                "loss_scale": loss_scale_summary(run), "missing_ranks": run.missing_ranks if ranks is None else [],
                "missing_warning": run.missing_warning if ranks is None else None}


def format_report(result: dict) -> str:
    lines = [f"run: {result['run']}"]
    if not result["saturation_counted"]:
        lines.append("note: the run's ops have no `sat`: only Inf and NaN are seen (add \"sat\" to `ops`)")
    if not result["modules"]:
        lines.append("no saturated or non-finite value found")
    for i, entry in enumerate(result["modules"]):
        micro = "" if entry["micro_step"] is None else f", micro-step {entry['micro_step']}"
        origin = " from the data" if entry["origin"] == FROM_DATA else ""
        lines.append(f"{'first' if i == 0 else 'then '}: {entry['module'] or '(root)'} {entry['tensor']} "
                     f"[{entry['phase']}, rank {entry['rank']}, step {entry['step']}{micro}]: {entry['what']}: "
                     f"{entry['class']}{origin}")
        lines.append(f"       next: {entry['next']}")
    scale = result["loss_scale"]
    if scale is not None:
        rate = "" if scale["rate"] is None else f" ({100 * scale['rate']:.1f}%)"
        lines.append(f"loss scaling: {int(scale['skipped'] or 0)} of {int(scale['updates'] or 0)} optimizer updates "
                     f"skipped for overflow{rate}; last loss scale {scale['loss_scale']}")
    return "\n".join(lines)
