"""`trainmon watch RUN_OR_ROOT`: the monitor daemon. It follows every rank's output as it is written and exports
one TensorBoard view (an overview first, then one chart per layer and family; per-tensor and per-rank detail
for what --detail and --ranks select), heatmaps, and live alerts naming the first NaN/Inf or spike across
ranks, into DIR (default <run>/watch/). It never writes into rank directories."""
from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import fields
from pathlib import Path

from trainmon.commands.arguments import add_ranks, positive_int
from trainmon.core.defaults import WATCH


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} is not above 0; give a number of seconds > 0")
    return value


def regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a regular expression ({err})") from None
    return text


def register(subparsers) -> None:
    parser = subparsers.add_parser("watch", help="follow a job's ranks: one TensorBoard view, heatmaps, live alerts",
                                   description=__doc__)
    parser.add_argument("path", metavar="RUN_OR_ROOT", help="a run directory (holding rank_<R>/) or the output root "
                                                            "(every run under it)")
    parser.add_argument("--logdir", metavar="DIR", type=Path,
                        help="output directory (default: <run>/watch/, or <root>/watch/<run>/ for a root)")
    parser.add_argument("--interval", type=positive_seconds, default=WATCH.interval, metavar="S",
                        help=f"seconds between rounds (default {WATCH.interval:g})")
    parser.add_argument("--once", action="store_true", help="export what is there and exit (a finished run)")
    add_ranks(parser, help="also write every figure of these ranks as their own series (rank<R>/...; --rank 3, "
                           "or --ranks 3 5)")
    parser.add_argument("--detail", nargs="+", default=[], metavar="REGEX", type=regex,
                        help="also chart every op of the tensors whose name matches one of these regular "
                             "expressions, e.g. 'layers\\.3\\.' (detail/...; default: one chart per layer)")
    parser.add_argument("--on-anomaly", metavar="CMD", help="shell command run with each alert as JSON on stdin")
    parser.add_argument("--exit-on-anomaly", action="store_true", help="exit (status 3) after the first alert")
    parser.add_argument("--stall-after", type=positive_seconds, default=WATCH.stall_after, metavar="S",
                        help="report a rank that commits no step for S seconds as stalled "
                             f"(default {WATCH.stall_after:g})")
    parser.add_argument("--heatmap-every", type=positive_int, metavar="N",
                        help=f"redraw the heatmaps every N steps, and at exit (default: {WATCH.heatmap_every}; "
                             "with --once, only at exit)")
    parser.add_argument("--op", default=WATCH.op, help=f"the op the module heatmaps show (default {WATCH.op})")
    parser.add_argument("--window", type=positive_int, default=WATCH.window, metavar="N",
                        help=f"steps the heatmaps show (default {WATCH.window})")
    parser.add_argument("--source", choices=("auto", "db", "csv"), default=WATCH.source,
                        help="read monitor.db or the CSV files (default: the database when present)")
    parser.add_argument("--until-done", action="store_true", help="exit once every rank has finished")
    parser.add_argument("--follow-pid", type=positive_int, metavar="PID",
                        help="exit after a last round when this process (the job) has ended")
    parser.set_defaults(handler=run)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each message: a program that runs `main(["watch", ...])` more than once
    may have replaced it in between (and closed the old one)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def watch_options(args: argparse.Namespace):
    """The daemon's settings from the flags: each of WatchOptions' fields is the flag of its name."""
    from trainmon.watch.run_watcher import WatchOptions
    chosen = {key.name: getattr(args, key.name) for key in fields(WatchOptions)}
    return WatchOptions(**{**chosen, "ranks": frozenset(args.ranks or ()), "detail": tuple(args.detail)})


def run(args: argparse.Namespace) -> int:
    from trainmon.watch.daemon import Daemon
    log = logging.getLogger("trainmon.watch")
    if not log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    options = watch_options(args)
    return Daemon(Path(args.path), options, until_done=args.until_done, follow_pid=args.follow_pid).run()
