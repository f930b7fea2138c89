"""`trainmon plot RUN --family F --op norm -o file.png`: the daemon's layer × step heatmap of a finished
run (max across tensors and ranks, log scale; NaN, +Inf and -Inf in their own colours, the first NaN/Inf
circled); `--columns rank` for layer × rank at the last step, `--rows tensor` for one row per tensor. A
picture of more rows than fit is written as FILE_part1ofN.png, ..."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainmon.commands.arguments import positive_int
from trainmon.commands.notices import warn


def register(subparsers) -> None:
    parser = subparsers.add_parser("plot", help="draw a heatmap of a run (layer x step, layer x rank, rank x step)",
                                   description=__doc__)
    parser.add_argument("dir", help="a run directory (holding rank_<R>/) or the output root (latest run)")
    parser.add_argument("--family", required=True, help="e.g. actv, grad_reduced, exp_avg; or loss / grad_norm "
                                                        "for the rank x step picture")
    parser.add_argument("--op", default="norm", help="the op to show (default norm)")
    parser.add_argument("--rows", choices=("layer", "tensor"), default="layer",
                        help="a row per layer (default: the largest of its tensors) or per tensor")
    parser.add_argument("--columns", choices=("step", "rank"), default="step",
                        help="a column per step (default) or per rank at the last step; loss and grad_norm are "
                             "always rank x step")
    parser.add_argument("--window", type=positive_int, default=1000, help="the last N steps (default 1000)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="the PNG file to write")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from trainmon.analysis.nan_analyze import analyze
    from trainmon.read.layout import find_run
    from trainmon.watch.follow import RankFollower
    from trainmon.watch.heatmap import pictures
    from trainmon.watch.history import RANK_SERIES, History
    from trainmon.watch.run_watcher import read_figures
    run_dirs = find_run(args.dir)  # cli.main reports an InputError (exit 2)
    warn(args, run_dirs.missing_warning)
    history = History(args.op, args.window)
    followers = [RankFollower(rank_dir) for rank_dir in run_dirs.ranks]
    for follower in followers:
        warn(args, follower.poll(final=True))
    last = max((f.latest for f in followers if f.latest is not None), default=None)
    if last is None:
        print(f"trainmon plot: {run_dirs.path} holds no committed step", file=sys.stderr)
        return 1
    first = max(0, last - args.window + 1)
    figures = read_figures(followers, first, last)
    ops = sorted({key[3] for figure in figures.values() for key in figure.stats})
    if ops and args.op not in ops and args.family not in RANK_SERIES:
        print(f"trainmon plot: no op {args.op!r} in {run_dirs.path}; --op takes: {', '.join(ops)}", file=sys.stderr)
        return 2
    for step in sorted(figures):
        history.add(figures[step])
    families = sorted(history.rows) + [s for s in RANK_SERIES if any(s in c for _, c in history.rank_columns)]
    if args.family not in families:
        print(f"trainmon plot: no {args.family!r} with op {args.op!r} in {run_dirs.path}; available: "
              f"{', '.join(families) or 'none'}", file=sys.stderr)
        return 2
    kind = "rank_x_step" if args.family in RANK_SERIES else f"{args.rows}_x_{args.columns}"
    wanted = f"{args.family}_{kind}"
    drawn = pictures(history, analyze(run_dirs.path)["first"], families=[args.family], rows=args.rows)
    chosen = [p for p in drawn if p.name == wanted or p.name.startswith(f"{wanted}_part")]
    if not chosen:
        print(f"trainmon plot: no {kind} picture of {args.family!r} with op {args.op!r} in {run_dirs.path}; "
              f"available: {sorted(p.name for p in drawn) or 'none'}", file=sys.stderr)
        return 2
    output = Path(args.output)
    for picture in chosen:
        path = output.with_name(output.stem + picture.name[len(wanted):] + output.suffix)
        try:
            path.write_bytes(picture.png)
        except OSError as err:
            print(f"trainmon plot: cannot write {path}: {err.strerror or err}", file=sys.stderr)
            return 2
        print(f"wrote {path} ({picture.width}x{picture.height}, {kind} of {args.family} {args.op})")
    return 0
