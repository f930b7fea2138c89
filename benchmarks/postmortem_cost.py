"""The post-mortem's cost per rank, and its main process's cost at many ranks, on a run of generate_run.py.

Per rank (CPU, one process, every rank of the run): nan-analyze's per-rank summary, `anomalies --top 10`'s
per-rank read, and one database's 41-step `family()` window. Then the main process of nan-analyze at
`--world` ranks: the run's real rank summaries repeated with new rank numbers (the all_reduce's group
renamed to all of them), pickled as the workers send them, unpickled and merged as `analyze` does.

    python benchmarks/postmortem_cost.py /tmp/r8 --first-step 700 --world 1024
"""
from __future__ import annotations

import argparse
import dataclasses
import pickle
import resource
import time

from trainmon.anomaly import nan_analyze
from trainmon.anomaly.rank_summary import summarize_rank_dir
from trainmon.commands.anomalies import rank_top
from trainmon.read.layout import find_run
from trainmon.read.run import _db_columns


def per_rank(ranks, first_step: int) -> None:
    for name, work in [("nan-analyze summary", summarize_rank_dir),
                       ("anomalies --top 10", lambda d: rank_top((d, 10, None))),
                       ("family(), 41 steps", lambda d: _db_columns((d.db, "grad_reduced", first_step, first_step + 40)))]:
        work(ranks[0])  # warm: the page cache, the imports
        started = time.process_time()
        for rank_dir in ranks:
            work(rank_dir)
        print(f"{name}: {(time.process_time() - started) / len(ranks) * 1e3:.0f} ms CPU per rank ({len(ranks)} ranks)")


def main_process(path: str, ranks, world: int) -> None:
    base = [summarize_rank_dir(d) for d in ranks]
    group = f"[0-{len(base) - 1}]"

    def renamed(summary, rank):
        fix = lambda e: dataclasses.replace(e, rank=rank, module=e.module.replace(group, f"[0-{world - 1}]"))
        return dataclasses.replace(summary, rank=rank, firsts=[fix(e) for e in summary.firsts],
                                   comm=[fix(e) for e in summary.comm])

    # the origin rank stays the only one: the other copies are of a rank that received the Inf
    origin = next(s for s in base if s.firsts and s.firsts[0].phase == "forward")
    plain = next(s for s in base if s is not origin)
    blob = pickle.dumps([renamed(origin if r == origin.rank else plain, r) for r in range(world)])
    started = time.process_time()
    summaries = pickle.loads(blob)
    unpickled = time.process_time()
    nan_analyze._summaries = lambda *_: (path, {str(s.rank): s.sources for s in summaries}, [], summaries, None)
    result = nan_analyze.analyze(path)
    print(f"main process at {world} ranks: unpickling the summaries {unpickled - started:.1f} s, merging "
          f"{time.process_time() - unpickled:.1f} s CPU ({len(blob) / 1e6:.0f} MB pickled), peak RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB; first: rank {result['first']['rank']} "
          f"step {result['first']['step']} {result['first']['module']}, {len(result['chain'])} chain places, "
          f"{result['nonfinite_records']} non-finite records")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run of generate_run.py")
    parser.add_argument("--first-step", type=int, default=700, help="the family() window's first step")
    parser.add_argument("--world", type=int, default=1024, help="ranks of the main process's merge")
    args = parser.parse_args()
    ranks = find_run(args.run).ranks
    per_rank(ranks, args.first_step)
    main_process(args.run, ranks, args.world)


if __name__ == "__main__":
    main()
