"""What a run holds, for the commands that judge it: an empty selection (a --steps range outside the run, a run
that collected nothing) is bad input, never "clean", "nothing found" or "the runs differ"."""
from __future__ import annotations

from typing import Sequence

from trainmon.read.errors import InputError
from trainmon.read.run import Run, Steps, step_range


def check_steps(run: Run, ranks: Sequence[int], steps: Steps) -> None:
    """A step range must hold steps of the run (on `ranks`).

    Raises:
        InputError: the run holds no step of `steps`, naming the steps it holds.
    """
    if steps is None:
        return
    first, last = step_range(steps)
    held = set().union(*(run.steps(rank) for rank in ranks))
    if not any((first is None or s >= first) and (last is None or s <= last) for s in held):
        span = f"steps {min(held)}-{max(held)}" if held else "no step"
        raise InputError.at(run.path, f"holds no step in --steps {'' if first is None else first}-"
                                      f"{'' if last is None else last} (it holds {span})")


def holds_records(run: Run, ranks: Sequence[int], steps: Steps = None) -> bool:
    """Whether one of `ranks` holds a statistic record (within `steps`); logged scalars and anomalies are none."""
    return any(next(iter(run.iter_steps(rank, steps=steps)), None) is not None for rank in ranks)


def require_records(run: Run, ranks: Sequence[int], steps: Steps = None) -> None:
    """Raises InputError: none of `ranks` holds a statistic record (within `steps`)."""
    if not holds_records(run, ranks, steps):
        raise InputError.at(run.path, "holds no statistic record" + ("" if steps is None else " in those steps") +
                            " (its config collected none: see start_step, step_interval, collect_times and "
                            "module_ranks); there is nothing to judge")
