"""`trainmon plot RUN --family F --op norm -o file.png`: the daemon's module × step heatmap of a finished
run (max across ranks, log scale; NaN, +Inf and -Inf in their own colours, the first NaN/Inf circled)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainmon.commands.arguments import positive_int
from trainmon.commands.notices import warn


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="draw a heatmap of a run (module x step, rank x step, module x rank)",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--family", required=True, help="e.g. actv, grad_reduced, exp_avg; or loss / grad_norm "
                                                        "for the rank x step picture")
    parser.add_argument("--op", default="norm", help="the op to show (default norm)")
    parser.add_argument("--kind", choices=("module_x_step", "module_x_rank", "rank_x_step"), default=None,
                        help="default: rank_x_step for loss/grad_norm, else module_x_step")
    parser.add_argument("--window", type=positive_int, default=1000, help="the last N steps (default 1000)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the PNG file to write")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.anomaly.nan_analyze import analyze
    from trainmon.read.layout import find_run
    from trainmon.watch.follow import RankFollower
    from trainmon.watch.heatmap import pictures
    from trainmon.watch.history import RANK_SERIES, History
    from trainmon.watch.run_watcher import read_figures
    run_dirs = find_run(args.dir)  # cli.main reports an InputError (exit 2)
    warn("plot", run_dirs.missing_warning)
    history = History(args.op, args.window)
    followers = [RankFollower(rank_dir) for rank_dir in run_dirs.ranks]
    for follower in followers:
        follower.poll(final=True)
    last = max((f.latest for f in followers if f.latest is not None), default=None)
    if last is None:
        print(f"trainmon plot: {run_dirs.path} holds no committed step", file=sys.stderr)
        return 1
    first = max(0, last - args.window + 1)
    figures = read_figures(followers, first, last)
    for step in sorted(figures):
        history.add(figures[step])
    families = sorted(history.rows) + [s for s in RANK_SERIES if any(s in c for _, c in history.rank_columns)]
    if args.family not in families:
        print(f"trainmon plot: no {args.family!r} with op {args.op!r} in {run_dirs.path}; available: "
              f"{', '.join(families) or 'none'}", file=sys.stderr)
        return 2
    kind = args.kind or ("rank_x_step" if args.family in RANK_SERIES else "module_x_step")
    wanted = f"{args.family}_{kind}"
    drawn = {p.name: p for p in pictures(history, analyze(run_dirs.path)["first"], families=[args.family])}
    if wanted not in drawn:
        print(f"trainmon plot: no {kind} picture of {args.family!r} with op {args.op!r} in {run_dirs.path}; "
              f"available: {sorted(drawn) or 'none'}", file=sys.stderr)
        return 2
    try:
        Path(args.output).write_bytes(drawn[wanted].png)
    except OSError as err:
        print(f"trainmon plot: cannot write {args.output}: {err.strerror or err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} ({drawn[wanted].width}x{drawn[wanted].height}, {kind} of {args.family} {args.op})")
    return 0
