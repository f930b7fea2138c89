"""Checks a multi-process job's CSV output against the figures the job computed directly."""
from __future__ import annotations

import glob
import json
import math
import os

from test_csv_output import read_family

SHARDED_FAMILIES = ("grad_reduced", "param_origin", "param_updated", "exp_avg", "exp_avg_sq")
SAVED_FAMILIES = ("save", "save_grad")  # the jobs' SavedLogits


def the_run(output_dir) -> str:
    """The one run directory every rank wrote to."""
    runs = [d for d in glob.glob(os.path.join(output_dir, "*")) if os.path.isdir(d)]
    assert len(runs) == 1, f"expected one run directory shared by all ranks, found {runs}"
    return runs[0]


def norms(rank_dir: str, family: str, per_micro: bool = False) -> dict:
    """{(step, name): norm} of one family, written once per (step, vpp_stage, name); the name of a virtual
    pipeline chunk after the first gets a `<vpp_stage>:` prefix. With `per_micro`, written once per
    micro-step too, and named `<name>@<micro_step>`."""
    frame = read_family(rank_dir, family)
    index = ["step", "micro_step", "vpp_stage", "name"] if per_micro else ["step", "vpp_stage", "name"]
    assert not frame.duplicated(index).any(), f"{family}: repeated rows in {rank_dir}"
    out = {}
    for r in frame.itertuples():
        name = f"{r.vpp_stage}:{r.name}" if r.vpp_stage else r.name
        out[(int(r.step), f"{name}@{int(r.micro_step)}" if per_micro else name)] = float(r.norm)
    return out


# What places a record: a (tag, rank, step, micro-step) written twice is one call recorded twice, whatever the two
# rows' call indices (a wrapper and the module it wraps each took one).
RECORD_PLACE = ("rank", "family", "vpp_stage", "name", "shape", "dtype", "step", "micro_step")


def assert_one_record_per_call(run_dir: str) -> int:
    """No record place of any family is written twice, on any rank; returns the number of records read."""
    import collections

    from trainmon import open_run

    with open_run(run_dir) as run:
        frame = run.records()
    assert len(frame), f"no records in {run_dir}"
    places = collections.Counter(tuple(str(v) for v in row)
                                 for row in frame[list(RECORD_PLACE)].itertuples(index=False))
    repeated = sorted(place for place, count in places.items() if count > 1)
    assert not repeated, f"{len(repeated)} places written more than once, such as {repeated[:3]} ({RECORD_PLACE})"
    return len(frame)


def truth(out_dir: str, rank: int) -> dict:
    with open(os.path.join(out_dir, f"truth.rank{rank}.json")) as f:
        return json.load(f)


def assert_norms_match(run_dir: str, out_dir: str, ranks, families, rel=1e-5, per_micro=False) -> int:
    """Every norm the job computed directly appears in the CSV with the same value; returns the count.

    With `per_micro` the families' figures are per micro-step (see `norms` and `Truth.add`)."""
    checked = 0
    for rank in ranks:
        expected = truth(out_dir, rank)
        for family in families:
            written = norms(os.path.join(run_dir, f"rank_{rank}"), family, per_micro)
            assert expected, f"rank {rank}: the job computed nothing to compare with"
            for step, by_family in expected.items():
                assert by_family.get(family), f"rank {rank} {family} step {step}: nothing computed directly"
                for name, value in by_family[family].items():
                    got = written.get((int(step), name))
                    assert got is not None, f"rank {rank} {family} step {step} {name}: missing"
                    assert math.isclose(got, value, rel_tol=rel, abs_tol=1e-12), \
                        f"rank {rank} {family} step {step} {name}: written {got}, direct {value}"
                    checked += 1
    return checked


def differing(run_dir: str, family: str, rank_a: int, rank_b: int, per_micro=False) -> tuple[int, int]:
    """(rows that differ, rows compared) between two ranks' records of a family. Norms of the same values
    agree to fp32 summation order only: each rank reads with the one-pass kernels from the step its own
    compile of them ends, with the multi-pass kernels before."""
    a = norms(os.path.join(run_dir, f"rank_{rank_a}"), family, per_micro)
    b = norms(os.path.join(run_dir, f"rank_{rank_b}"), family, per_micro)
    common = set(a) & set(b)
    assert common, f"{family}: ranks {rank_a} and {rank_b} share no records"
    return sum(not math.isclose(a[k], b[k], rel_tol=1e-6) for k in common), len(common)


def assert_reduced_is_the_mean(run_dir: str, out_dir: str, ranks, rel=1e-5, max_norm=None) -> int:
    """Every rank's grad_reduced (norm, min, max) is that of the mean of all ranks' own grads, which the job
    saved (common.LocalGrads) and this averages; with `max_norm`, clipped as torch and DeepSpeed clip (by
    min(1, max_norm / (total norm + 1e-6))), which must bite at every step. Returns the number of records checked."""
    import torch

    local = [torch.load(os.path.join(out_dir, f"local_grads.rank{rank}.pt")) for rank in ranks]
    assert local[0] and all(grads.keys() == local[0].keys() for grads in local)
    mean = {key: torch.stack([grads[key].double() for grads in local]).mean(dim=0) for key in local[0]}
    if max_norm is not None:
        for step in {step for step, _ in mean}:
            total = math.sqrt(sum(float(g.norm()) ** 2 for (s, _), g in mean.items() if s == step))
            assert max_norm < total, f"step {step}: clipping to {max_norm} does not bite (norm {total})"
            for key in [key for key in mean if key[0] == step]:
                mean[key] = mean[key] * (max_norm / (total + 1e-6))
    checked = 0
    for rank in ranks:
        frame = read_family(os.path.join(run_dir, f"rank_{rank}"), "grad_reduced")
        written = {(int(r.step), r.name): r for r in frame.itertuples()}
        for (step, name), grad in mean.items():
            row = written.get((step, name))
            assert row is not None, f"rank {rank} step {step} {name}: no grad_reduced record"
            for op, value in (("norm", grad.norm()), ("min", grad.min()), ("max", grad.max())):
                assert math.isclose(getattr(row, op), float(value), rel_tol=rel, abs_tol=1e-9), \
                    f"rank {rank} step {step} {name} {op}: written {getattr(row, op)}, mean of the ranks' {value}"
            checked += 1
    return checked


def assert_clipped(run_dir: str, out_dir: str, ranks, max_norm: float, rel=1e-5) -> int:
    """The framework clipped every step (the clip bites): each rank wrote `grad_clip_coef` < 1, equal to
    min(1, max_norm / (grad_norm_preclip + 1e-6)), with `grad_norm_preclip` the total norm of the grads before
    clipping that the job computed (`grad_preclip`, the whole model on each rank), and every grad_reduced
    record is that grad_preclip times the coefficient. Returns the number of records checked."""
    from trainmon import open_run

    with open_run(run_dir) as run:
        scalars = {(int(r.rank), r.name, int(r.step)): r.value for r in run.scalars().itertuples()}
    checked = 0
    for rank in ranks:
        written = norms(os.path.join(run_dir, f"rank_{rank}"), "grad_reduced")
        for step, by_family in truth(out_dir, rank).items():
            preclip = by_family["grad_preclip"]
            coef, norm = (scalars.get((rank, name, int(step))) for name in ("grad_clip_coef", "grad_norm_preclip"))
            assert coef is not None and norm is not None, f"rank {rank} step {step}: no clipping scalars"
            assert math.isclose(norm, math.sqrt(sum(v * v for v in preclip.values())), rel_tol=rel)
            assert coef < 0.99 and math.isclose(coef, min(1.0, max_norm / (norm + 1e-6)), rel_tol=rel), (coef, norm)
            for name, value in preclip.items():
                got = written[(int(step), name)]
                assert math.isclose(got, value * coef, rel_tol=rel, abs_tol=1e-12), \
                    f"rank {rank} step {step} {name}: grad_reduced {got}, before clipping {value} x {coef}"
                checked += 1
    return checked


def assert_same_labels(run_dir: str, families, rank_a: int, rank_b: int) -> None:
    """Two ranks label the records they share (same step, vpp_stage and name) with the same dtype."""
    for family in families:
        a, b = ({(int(r.step), r.vpp_stage, r.name): r.dtype
                 for r in read_family(os.path.join(run_dir, f"rank_{rank}"), family).itertuples()}
                for rank in (rank_a, rank_b))
        common = a.keys() & b.keys()
        assert common, f"{family}: ranks {rank_a} and {rank_b} share no records"
        differ = sorted((k, a[k], b[k]) for k in common if a[k] != b[k])
        assert not differ, f"{family}: dtype labels differ between ranks {rank_a} and {rank_b}: {differ[:3]}"


def nan_analyze(run_dir: str, text: bool = False):
    """`trainmon nan-analyze --json` of a run (its text report with `text`), as a user would run it."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "trainmon.cli", "nan-analyze", run_dir] + ([] if text else ["--json"]),
                          capture_output=True, text=True, timeout=120)
    clean = ("clean: no NaN or Inf" in done.stdout) if text else json.loads(done.stdout)["first"] is None
    assert done.returncode == (0 if clean else 1), done.stderr  # 0 clean, 1 found
    return done.stdout if text else json.loads(done.stdout)


def assert_unpatched(out_dir, ranks) -> None:
    """stop() removed every instance-level wrapper from the framework objects (see common.finish)."""
    for rank in ranks:
        restored = json.load(open(os.path.join(out_dir, f"restored.rank{rank}.json")))
        assert restored["objects"] > 0 and restored["leftovers"] == [], restored


WHERE = ("rank", "step", "micro_step", "module", "phase")


def source_variants(run_dir: str, copies) -> dict:
    """{variant: run directory}: the run itself ("all": csv, db, anomalies.jsonl), and copies of it as other
    configs would have written it: "db" (no CSV files), "csv" (no monitor.db) and "csv-only" (the CSV files
    and run.json: neither the sentinel nor alert rules were on)."""
    import shutil

    out = {"all": run_dir}
    for variant, ignored in (("db", ("*.csv",)), ("csv", ("monitor.db*",)),
                             ("csv-only", ("anomalies.jsonl", "monitor.db*"))):
        out[variant] = str(copies / variant)
        shutil.copytree(run_dir, out[variant], ignore=shutil.ignore_patterns(*ignored))
    return out


def assert_injection_named(run_dir: str, copies, expected: dict, cc: str, csv_peers=()) -> None:
    """The injected inf (`expected`: rank, step, micro_step, module, phase) is what the online alert of its rank
    names first, and what `nan-analyze --json` names first from every source; with collectives recorded (and
    their inputs, `cc` "on"), their records trace it to the injected rank.

    From CSV rows alone (no call indices) ranks of the same stage are ties: there the injected record may be
    listed among the ties of one of the `csv_peers` ranks.
    """
    from trainmon.analysis.nan_analyze import analyze

    rank_dir = os.path.join(run_dir, f"rank_{expected['rank']}")
    online = [json.loads(line) for line in open(os.path.join(rank_dir, "anomalies.jsonl"))]
    assert min(r["step"] for r in online) == expected["step"], "nothing anomalous before the injection"
    first_online = next(r for r in online if r["first"] and r["step"] == expected["step"])
    assert {k: first_online[k] for k in WHERE} == expected, first_online
    # the run as a user would analyse it; the copies in this process (one CLI start costs seconds)
    reports = {variant: nan_analyze(path) if variant == "all" else analyze(path)
               for variant, path in source_variants(run_dir, copies).items()}
    for variant, report in reports.items():
        named = [{k: place[k] for k in WHERE} for place in [report["first"]] + report["ties"]]
        if variant == "csv-only" and named[0]["rank"] in csv_peers:
            assert expected in named, (variant, named)
        else:
            assert named[0] == expected, (variant, report["first"])
        cross = report["cross_rank"]
        if cc == "off":
            assert cross is None, variant
        elif cc == "on":
            assert cross["origin_rank"] == expected["rank"] and cross["unattributed"] == [], (variant, cross)
    # the record also read from CSV is reported from a source that has its call index
    assert reports["all"]["first"]["call_index"] is not None and reports["csv-only"]["first"]["call_index"] is None


def assert_sharding_collectives(run_dir: str, steps: int, gather: str, scatter: str) -> None:
    """A sharded data-parallel job on ranks 0 and 1 (ZeRO, FSDP2) with cc_distribution on: at every step both ranks
    recorded the same `gather` (param all-gather) and `scatter` (grad reduction) calls on their group; a gather's
    output is the concatenation of the ranks' inputs (its norm² is the sum of theirs; the same on both ranks), and
    the scatters' outputs are finite, non-zero grads."""
    from trainmon.core.collective_ops import parse_comm_name

    figures = {}  # rank: {(step, call, io): (norm, max)}
    for rank in (0, 1):
        frame = read_family(os.path.join(run_dir, f"rank_{rank}"), "comm")
        for r in frame.itertuples():
            parsed = parse_comm_name(r.name)
            if parsed["op"] in (gather, scatter) and parsed["ranks"] == [0, 1]:
                call = r.name.rsplit(".", 1)[0]
                figures.setdefault(rank, {})[(int(r.step), call, parsed["io"])] = (r.norm, r.max)
    assert figures.get(0) and figures.keys() == {0, 1} and figures[0].keys() == figures[1].keys(), \
        "both ranks record the same calls"
    for step in range(steps):
        calls = {call for s, call, _ in figures[0] if s == step}
        assert {c.split("[")[0] for c in calls} == {gather, scatter}, (step, sorted(calls))
        for call in calls:
            out = [figures[rank][(step, call, "output")] for rank in (0, 1)]
            if call.startswith(gather + "["):
                inputs = [figures[rank][(step, call, "input")][0] for rank in (0, 1)]
                # the max exact, the norm to fp32 summation order (see differing)
                assert out[0][1] == out[1][1] and math.isclose(out[0][0], out[1][0], rel_tol=1e-6), (step, call, out)
                assert math.isclose(out[0][0] ** 2, inputs[0] ** 2 + inputs[1] ** 2, rel_tol=1e-5), (step, call)
            else:
                assert all(0 < norm < math.inf for norm, _ in out), (step, call, out)
