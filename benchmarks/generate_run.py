"""Writes a large run for the post-mortem figures, with trainmon's own writers (CSV, db, anomalies.jsonl).

The shape of the run that issue 11 measured: every rank writes `format` ["csv", "db"] plus
anomalies.jsonl (rule AnomalyNan, also into the db), 66 records per step: 8 module outputs (forward),
8 activation grads (backward), 16 grads before and 16 after the data-parallel all_reduce, 16 parameters,
and the all_reduce's input and output. Every rank draws its own figures (its own seed), so no two ranks'
files are alike. An Inf enters one rank's `layers.<--inf-layer>` forward output at `--inf-step`; it
reaches that rank's later modules and grads, then every rank through the grad all_reduce; from the next
step every parameter, and so every record, is non-finite on every rank, as in a real incident.

    python benchmarks/generate_run.py OUT --ranks 256 --steps 1000 --origin-rank 129 --inf-step 733 --inf-layer 5

Writing costs 1.6 ms of CPU per rank and step (3.8 ms once every record holds the Inf), and 17 MB per rank of
1,000 steps.
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from trainmon.anomaly.processor import AnomalyProcessor
from trainmon.anomaly.rules import build_rules
from trainmon.config.settings import RuleConfig
from trainmon.core.collective_ops import collective_name, compact_ranks
from trainmon.config.output import run_metadata
from trainmon.core.layout import WRITER_REPORT
from trainmon.core.records import (ACTV, ACTV_GRAD, ACTIVATION_FAMILIES, COMM, GRAD_REDUCED, GRAD_UNREDUCED,
                                      PARAM_ORIGIN, RecordKey, StepBatch)
from trainmon.engine import stats
from trainmon.core.derive import derive_rows
from trainmon.writers.base import SinkContainer, SinkContext
from trainmon.writers.registry import build_sinks

OPS = ("min", "max", "norm", "mean", "nans", "infs")
LAYERS = 8
PARAMS = [f"layers.{i}.mlp.{j}.weight" for i in range(LAYERS) for j in (0, 2)]
SHAPE = (64, 64)
INF_LAYER = 3  # the layer the Inf enters, by default


def _keys(world: int) -> list[RecordKey]:
    """The 66 records of one step, in call order."""
    keys, call = [], 0

    def add(family, name, micro):
        nonlocal call
        keys.append(RecordKey(family, name, 0, micro, call, SHAPE, "torch.float32"))
        call += 1

    for i in range(LAYERS):
        add(ACTV, f"layers.{i}.output", 0)
    for i in reversed(range(LAYERS)):
        add(ACTV_GRAD, f"layers.{i}.input", 0)
    for name in PARAMS:
        add(GRAD_UNREDUCED, name, None)
    base = collective_name("all_reduce", compact_ranks(range(world)), "dp", 0)
    add(COMM, f"{base}.input", None)
    add(COMM, f"{base}.output", None)
    for name in PARAMS:
        add(GRAD_REDUCED, name, None)
    for name in PARAMS:
        add(PARAM_ORIGIN, name, None)
    return keys


def _nonfinite(keys: list[RecordKey], rank: int, step: int, origin: int, inf_step: int, inf_layer: int) -> np.ndarray:
    """Which records hold an Inf at `step` on `rank`."""
    if step > inf_step:
        return np.ones(len(keys), dtype=bool)
    if step < inf_step:
        return np.zeros(len(keys), dtype=bool)
    bad = np.zeros(len(keys), dtype=bool)
    for i, key in enumerate(keys):
        if key.family in (GRAD_REDUCED,) or (key.family == COMM and key.name.endswith(".output")):
            bad[i] = True  # the all_reduce's sum brings it to every rank
        elif rank == origin:
            layer = int(key.name.split(".")[1]) if key.family in ACTIVATION_FAMILIES else None
            bad[i] = (key.family == ACTV and layer >= inf_layer) or key.family in (ACTV_GRAD, GRAD_UNREDUCED) \
                or (key.family == COMM and key.name.endswith(".input"))
    return bad


def write_rank(job: tuple) -> None:
    """Writes rank `rank` of the run (job: out, rank, world size, steps, origin rank, Inf step[, the layer it
    enters: INF_LAYER when not given])."""
    out, rank, world, steps, origin, inf_step, inf_layer = job if len(job) == 7 else (*job, INF_LAYER)
    rank_dir = Path(out) / f"rank_{rank}"
    config = {"ops": list(OPS), "format": ["csv", "db"], "alert": {"rules": [{"rule_name": "AnomalyNan"}]}}
    metadata = run_metadata(config, rank, world, {"pp_stage": 0})
    rank_dir.mkdir(parents=True, exist_ok=True)
    (rank_dir / "run.json").write_text(json.dumps(metadata))
    # the anomaly processor first: its connection to monitor.db closes first, and the database's own close, the
    # last, removes the -wal without waiting for the other to let go
    sinks = SinkContainer([AnomalyProcessor(build_rules([RuleConfig(rule_name="AnomalyNan")]), database=True)]
                          + build_sinks(["csv", "db"]))
    sinks.start(SinkContext(rank_dir=rank_dir, rank=rank, ops=OPS, ndigits=8, step_count_per_record=1000,
                            per_micro_families=frozenset(ACTIVATION_FAMILIES), metadata=metadata))
    keys = _keys(world)
    rng = np.random.default_rng(rank)
    n = float(math.prod(SHAPE))
    try:
        for step in range(steps):
            values = np.empty((len(keys), stats.N_FIELDS))
            values[:] = (n, 0, 0, 0, 0.0, n, -1.0, 1.0, 0, 0)
            values[:, 4] = rng.normal(size=len(keys))
            bad = _nonfinite(keys, rank, step, origin, inf_step, inf_layer)
            values[bad] = (n - 1, 0, 1, 0, 0.0, n, -1.0, 1.0, 0, 1)  # one +Inf element
            batch = StepBatch(step=step, rank=rank, pp_stage=0, keys=keys, values=values, flags=np.empty(0))
            batch.deriver = functools.partial(derive_rows, ops=OPS)
            sinks.write(batch)
    finally:
        sinks.close()
    # what TrainerMon.stop() adds: the writer's report says the rank finished (a daemon does not wait for it)
    report = {"written_steps": steps, "dropped_steps": 0, "failed_steps": 0, "disabled_sinks": sinks.report()}
    (rank_dir / "run.json").write_text(json.dumps({**metadata, WRITER_REPORT: report}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the run directory to write (rank_<R>/ per rank)")
    parser.add_argument("--ranks", type=int, default=1024, help="ranks written (default 1024)")
    parser.add_argument("--steps", type=int, default=1000, help="steps per rank (default 1000)")
    parser.add_argument("--origin-rank", type=int, default=None, help="the rank the Inf starts on (default: ranks/3)")
    parser.add_argument("--inf-step", type=int, default=None, help="default: 70%% of the steps")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    parser.add_argument("--inf-layer", type=int, default=INF_LAYER, choices=range(LAYERS), metavar="L",
                        help=f"the layer whose forward output the Inf enters (default {INF_LAYER})")
    args = parser.parse_args()
    # the online alerts of every step would flood the terminal; the forked workers inherit the level
    logging.getLogger("trainmon").setLevel(logging.ERROR)
    origin = args.ranks // 3 if args.origin_rank is None else args.origin_rank
    inf_step = int(args.steps * 0.7) if args.inf_step is None else args.inf_step
    started = time.perf_counter()
    jobs = [(args.out, rank, args.ranks, args.steps, origin, inf_step, args.inf_layer) for rank in range(args.ranks)]
    with ProcessPoolExecutor(args.workers) as pool:
        list(pool.map(write_rank, jobs))
    print(f"wrote {args.ranks} ranks x {args.steps} steps to {args.out} in {time.perf_counter() - started:.0f} s; "
          f"Inf from rank {origin} step {inf_step} layers.{args.inf_layer}")


if __name__ == "__main__":
    main()
