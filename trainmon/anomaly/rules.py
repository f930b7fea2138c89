"""The rules of `alert.rules`, evaluated in the writer thread on each step's records and scalars.

A rule sees one series at a time: a tag (one tensor of one family, per micro-step where records are
per micro-step) or a scalar name, and returns the (op, value) pairs it finds anomalous. Rules with
history keep it per (tag, op); a NaN or Inf never enters a history, so one bad step cannot poison
the baseline of later ones.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Iterable, Mapping, Optional, Sequence

from trainmon.monitor import stats

NANS, INFS = stats.FIELDS.index("nans"), stats.FIELDS.index("infs")
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class Rule:
    """A rule; `check_record` gets a record's raw fields and derived ops, `check_scalar` a scalar."""

    name = "Rule"

    def check_record(self, tag: str, row: Sequence[float], ops: Mapping[str, Optional[float]]) -> list:
        return []

    def check_scalar(self, name: str, value: float) -> list:
        return []


class AnomalyNan(Rule):
    """Any NaN or ±Inf element, from the record's counts (a NaN never hides in a finite norm).

    Args:
        threshold: when given, also any op (or scalar) whose |value| exceeds it.
    """

    name = "AnomalyNan"

    def __init__(self, threshold: Optional[float] = None):
        self.threshold = threshold

    def check_record(self, tag, row, ops) -> list:
        found = [(op, row[i]) for op, i in (("nans", NANS), ("infs", INFS)) if row[i] > 0]
        if self.threshold is not None:
            found += [(op, v) for op, v in ops.items()
                      if op not in ("nans", "infs") and v is not None and abs(v) > self.threshold]
        return found

    def check_scalar(self, name, value) -> list:
        if not math.isfinite(value) or (self.threshold is not None and abs(value) > self.threshold):
            return [("value", value)]
        return []


class _SeriesRule(Rule):
    """A rule judged per (tag, op) against that series' finite history."""

    def __init__(self, ops: Optional[Iterable[str]]):
        self.ops = None if ops is None else frozenset(ops)

    def check_record(self, tag, row, ops) -> list:
        return [(op, v) for op, v in ops.items()
                if (self.ops is None or op in self.ops) and op not in ("nans", "infs", "zeros")
                and v is not None and self._judge((tag, op), v)]

    def check_scalar(self, name, value) -> list:
        return [("value", value)] if self._judge((name, "value"), value) else []

    def _judge(self, series: tuple, value: float) -> bool:
        if not math.isfinite(value):
            return False  # AnomalyNan's to report; kept out of the history
        anomalous = self._anomalous(series, value)
        self._remember(series, value)
        return anomalous

    def _anomalous(self, series: tuple, value: float) -> bool:
        raise NotImplementedError

    def _remember(self, series: tuple, value: float) -> None:
        raise NotImplementedError


class AnomalyTurbulence(_SeriesRule):
    """msprobe's rule: the value leaves (1 + threshold) x the running mean of its earlier values.

    Upwards when the mean is positive, downwards when it is negative.

    Args:
        threshold: allowed relative deviation from the running mean.
        ops: ops to judge (default: every configured op but nans, infs and zeros).
    """

    name = "AnomalyTurbulence"

    def __init__(self, threshold: float, ops: Optional[Iterable[str]] = None):
        super().__init__(ops)
        self.threshold = threshold
        self._sums: dict[tuple, tuple[float, int]] = {}

    def _anomalous(self, series, value) -> bool:
        total, count = self._sums.get(series, (0.0, 0))
        if not count:
            return False
        bound = (total / count) * (1 + self.threshold)
        return value > bound if bound > 0 else value < bound

    def _remember(self, series, value) -> None:
        total, count = self._sums.get(series, (0.0, 0))
        self._sums[series] = (total + value, count + 1)


class AnomalySpike(_SeriesRule):
    """A robust upward spike: (value - rolling median) / (1.4826 x rolling MAD) above `threshold`.

    The scale is floored at `min_relative` x |median|, so a value must also exceed the median by
    threshold x min_relative x |median| (defaults: 7x the median). Per-tensor norms of a healthy run
    jump 3-5x now and then (small tensors, small batches); harmful spikes are larger. Lower it for
    quiet series such as the loss. Nothing fires before `warmup` finite values are seen.

    Args:
        threshold: robust z-score that fires (default 6).
        window: finite values the median and MAD are taken over (default 50).
        warmup: values needed before the rule can fire (default min(window, 10)).
        min_relative: floor of the scale relative to |median| (default 1.0).
        ops: ops to judge (default ["norm"]; scalars are always judged).
    """

    name = "AnomalySpike"

    def __init__(self, threshold: float = 6.0, window: int = 50, warmup: Optional[int] = None,
                 min_relative: float = 1.0, ops: Optional[Iterable[str]] = ("norm",)):
        super().__init__(ops)
        if warmup is not None and warmup > window:
            raise ValueError(f"AnomalySpike warmup ({warmup}) must not exceed window ({window})")
        self.threshold = threshold
        self.window = window
        self.warmup = max(2, min(window, 10) if warmup is None else warmup)
        self.min_relative = min_relative
        self._history: dict[tuple, collections.deque] = {}

    def _anomalous(self, series, value) -> bool:
        history = self._history.get(series)
        if history is None or len(history) < self.warmup:
            return False
        median = statistics.median(history)
        mad = statistics.median(abs(v - median) for v in history)
        scale = max(_MAD_TO_SIGMA * mad, self.min_relative * abs(median), 1e-30)
        return (value - median) / scale > self.threshold

    def _remember(self, series, value) -> None:
        self._history.setdefault(series, collections.deque(maxlen=self.window)).append(value)


RULES = {cls.name: cls for cls in (AnomalyNan, AnomalyTurbulence, AnomalySpike)}


def build_rules(rule_configs) -> list[Rule]:
    """Rules from `alert.rules` entries (objects with `rule_name` and `args`).

    Raises:
        ValueError: an argument the rule does not take, naming the rule and what it takes.
    """
    rules = []
    for i, cfg in enumerate(rule_configs):
        cls = RULES[cfg.rule_name]
        try:
            rules.append(cls(**cfg.args))
        except TypeError as err:
            raise ValueError(f"alert.rules[{i}].args {cfg.args} do not fit {cfg.rule_name}: {err}; see the "
                             f"{cfg.rule_name} arguments in the README") from None
    return rules
