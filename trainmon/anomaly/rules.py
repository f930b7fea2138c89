"""The rules of `alert.rules`, evaluated in the writer thread on each step's records and scalars.

A rule sees one series at a time: a tag (one tensor of one family, per micro-step where records are
per micro-step) or a scalar name, and returns the (op, value) pairs it finds anomalous. Rules with
history keep it per (tag, op); a NaN or Inf never enters a history, so one bad step cannot poison
the baseline of later ones. Before a step's records are checked, `begin_step` shows a rule all of them,
so a rule can judge a record against the rest of its step (AnomalySpike's noise level); after them,
`end_step` returns what the rule found only because the step as a whole was anomalous (AnomalySpike's
trace back to the origin).
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

from trainmon.engine import stats
from trainmon.core.defaults import SPIKE_WINDOW
from trainmon.core.events import PRECURSOR_RULE
from trainmon.core.records import (ADAM_UPDATE, ATTENTION_HOOK, EXP_AVG_SQ, MOE_LOAD, MOE_ROUTER_LOGIT_HOOK,
                                   PARAM_UPDATED)

NANS, INFS = stats.FIELDS.index("nans"), stats.FIELDS.index("infs")
_MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


class Rule:
    """A rule; `check_record` gets a record's raw fields and derived ops, `check_scalar` a scalar."""

    name = "Rule"

    def begin_step(self, records: Sequence[tuple[str, str, Mapping[str, Optional[float]]]],
                   step: Optional[int] = None, keys: Optional[Sequence] = None) -> None:
        """Sees the step's records, (tag, family, ops) each, before any of them is checked; `step`: the step's
        number, `keys`: the records' RecordKeys, in the same order."""

    def check_record(self, tag: str, row: Sequence[float], ops: Mapping[str, Optional[float]]) -> list:
        return []

    def check_scalar(self, name: str, value: float) -> list:
        return []

    def end_step(self) -> list[tuple[str, str, float]]:
        """After the step's records and scalars were checked: (tag or scalar name, op, value) of the findings
        that count only because other values of the step were anomalous."""
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

    def _judges(self, op: str) -> bool:
        return (self.ops is None or op in self.ops) and op not in ("nans", "infs", "zeros")

    def check_record(self, tag, row, ops) -> list:
        return [(op, v) for op, v in ops.items() if self._judges(op) and v is not None and self._judge((tag, op), v)]

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
    """A robust upward spike over the series' recent trend.

    The baseline is a robust straight-line fit of the last `window` finite values: its slope joins the
    medians of their older and newer halves, its level is the median of the values with that slope taken
    out, and its spread the MAD of those detrended values. Series whose values are all positive (norms,
    moments) are fitted in log space, so steady geometric growth or decay (Adam's second moment filling
    up, grads shrinking as the loss falls) is a straight line; other series are fitted as they are. The
    value is then compared with the fit's prediction for this step, T:

    - its robust z-score, (value - T) / (1.4826 x MAD), in the space of the fit, is above `threshold`, and
    - it exceeds T by more than threshold x min_relative x |T| (defaults: it is above 7 x T).

    The second condition keeps smooth series, whose MAD is tiny, from firing on rounding noise, and lets
    healthy per-tensor norms jump 3-5x now and then. Only upward departures fire: a learning-rate
    warm-up (growth slowing down) or a decay stays below its trend. Nothing fires before `warmup` finite
    values are seen; a NaN or Inf never enters the history.

    A record's value at numerical-noise level is no spike: below `noise` x the largest |value| of the same
    family and op at that step (`noise`² for `exp_avg_sq`, whose values are squared grads). Such values
    are float rounding or fp32 underflow: an attention key bias, whose grad is mathematically zero, or a
    norm whose squares underflow, reads 0 for steps and then ~1e-23 (sqrt of the smallest denormal). A
    noise-level value never fires and clears its series' history, so a series leaving noise level warms up
    again: judged against its noise (or its zeros), its first real values would look like spikes.
    Scalars have no family and are always judged.

    A step is judged as a whole, so that a spike is named where it starts. A forward spike is often first
    over the bound downstream, in the backward: the backward of the spiked op multiplies the grad reaching
    it by the spike's factor, and that grad has itself grown, as the spike pushed the loss off its minimum;
    weight grads (input x grad output) and the grads further back compound it. In benchmarks/spike_suite.py
    a x5 spike of `layers.2.mlp`'s output is 4.7 x its trend, below the 7 x T that fires, while the grad
    reaching that output rises 1.4x, so `fc2`'s grad output is 5 x 1.4 = 7.1 x T and the MLP's weight
    grads 9-15 x T: the first value over the bound is `fc2` backward. So once a value of the step fires,
    every value of that step whose robust z-score is above `threshold` and that exceeds T by more than
    min_relative x |T| (above 2 x T with the defaults) is reported with it; the processor orders a step's
    anomalies causally, and the earliest is the spiked forward output. The 2 x T keeps out the smooth
    activations whose tiny MAD gives a high z-score to a 1.1 x T wobble: earlier in forward, one of them
    would be named. A healthy step has no value that fires, so this lower bound adds no false alarm.

    Args:
        threshold: robust z-score that fires, and the relative excess over the trend (default 6).
        window: finite values the trend is fitted to (default 50).
        warmup: values needed before the rule can fire (default min(window, 10)).
        min_relative: scales the relative excess that is required, and is the one traced (default 1.0).
        noise: the noise level relative to the family's largest value, 0 <= noise < 1 (default 1e-6;
            0 judges every value).
        ops: ops to judge (default ["norm"]; scalars are always judged).
    """

    name = "AnomalySpike"

    def __init__(self, threshold: float = 6.0, window: int = SPIKE_WINDOW, warmup: Optional[int] = None,
                 min_relative: float = 1.0, noise: float = 1e-6, ops: Optional[Iterable[str]] = ("norm",)):
        super().__init__(ops)
        if warmup is not None and warmup > window:
            raise ValueError(f"AnomalySpike warmup ({warmup}) must not exceed window ({window})")
        if not 0 <= noise < 1:
            raise ValueError(f"AnomalySpike noise ({noise}) must be >= 0 and < 1")
        self.threshold = threshold
        self.window = window
        self.warmup = max(2, min(window, 10) if warmup is None else warmup)
        self.min_relative = min_relative
        self.noise = noise
        self._history: dict[tuple, collections.deque] = {}
        self._floors: dict[tuple, float] = {}  # (tag, op) -> noise level of this step
        self._fired = False  # whether a value of this step fired
        self._traced: list[tuple[str, str, float]] = []  # this step's values above min_relative x |T|

    def end_step(self) -> list[tuple[str, str, float]]:
        traced = self._traced if self._fired else []
        self._fired, self._traced = False, []
        return traced

    def begin_step(self, records, step=None, keys=None) -> None:
        largest: dict[tuple, float] = collections.defaultdict(float)
        for _, family, ops in records:
            for op, v in ops.items():
                if self._judges(op) and v is not None and math.isfinite(v):
                    largest[family, op] = max(largest[family, op], abs(v))
        self._floors = {(tag, op): largest[family, op] * (self.noise ** 2 if family == EXP_AVG_SQ else self.noise)
                        for tag, family, ops in records for op in ops if (family, op) in largest}

    def _judge(self, series, value) -> bool:
        if abs(value) < self._floors.get(series, 0.0):
            self._history.pop(series, None)  # what came before the noise is no baseline for what follows it
            return False
        return super()._judge(series, value)

    def _anomalous(self, series, value) -> bool:
        history = self._history.get(series)
        if history is None or len(history) < self.warmup:
            return False
        logarithmic = value > 0 and min(history) > 0
        points = [math.log(v) for v in history] if logarithmic else list(history)
        predicted, spread = _trend(points)
        expected = math.exp(predicted) if logarithmic else predicted
        observed = math.log(value) if logarithmic else value
        if observed - predicted <= self.threshold * _MAD_TO_SIGMA * spread:
            return False
        unit = self.min_relative * abs(expected)  # the excess that is traced; `threshold` of them fire
        if value - expected > self.threshold * unit:
            self._fired = True
            return True
        if value - expected > unit:
            self._traced.append((*series, value))
        return False

    def _remember(self, series, value) -> None:
        self._history.setdefault(series, collections.deque(maxlen=self.window)).append(value)


def _trend(points: Sequence[float]) -> tuple[float, float]:
    """(prediction for the next point, MAD of the detrended points) of a robust line through `points`."""
    half = len(points) // 2
    # Medians of halves, not of step-to-step changes: noise that alternates up and down biases those.
    slope = (statistics.median(points[-half:]) - statistics.median(points[:half])) / (len(points) - half)
    detrended = [p - slope * i for i, p in enumerate(points)]
    level = statistics.median(detrended)
    return level + slope * len(points), statistics.median(abs(d - level) for d in detrended)


LEARNING_RATE = "lr"  # the logged scalar the update-to-weight ratio takes the learning rate from
BASELINE_SLOPES = 200  # the earlier slopes of a series its bound is taken from
BASELINE_MIN = 3  # windows of earlier slopes a series needs before it is judged


class Signal(NamedTuple):
    """A precursor AnomalyPrecursor watches: records of `families` whose name ends with one of `endings` (of
    matrices only, with `matrices`: not the norms' and biases' vectors), read by the first of `ops` they have,
    `falls` when a fall (not a growth) is the warning."""

    families: frozenset
    endings: tuple[str, ...]
    ops: tuple[str, ...]
    falls: bool
    matrices: bool = False


PRECURSORS: dict[str, Signal] = {
    # attention logits growing until the softmax saturates (the L2 attention features' max_logit)
    "max_logit": Signal(frozenset({ATTENTION_HOOK}), (".max_logit",), ("max", "norm"), False),
    # the router sending every token to the same experts (moe_load, or the L2 router-logit features)
    "router_entropy": Signal(frozenset({MOE_LOAD, MOE_ROUTER_LOGIT_HOOK}),
                             (".router_entropy", ".per_token_expert_entropy"), ("min", "norm"), True),
    # the update-to-weight ratio: the learning rate (the scalar `lr` the script logs) x Adam's step direction
    # m/(sqrt(v)+eps) (ur_distribution) over the weight it updates (param_distribution)
    "update_ratio": Signal(frozenset({ADAM_UPDATE}), ("weight",), ("norm",), False, matrices=True),
    # the weights themselves (param_distribution)
    "weight_norm": Signal(frozenset({PARAM_UPDATED}), ("weight",), ("norm",), False, matrices=True),
}


class _Series:
    """One precursor series: its values' logs (negated for a falling signal) with their steps, its recent slopes, and
    the bound a slope must exceed (from the slopes before the window, refreshed once a window)."""

    def __init__(self, window: int, baseline: int):
        self.logs: collections.deque = collections.deque(maxlen=window)
        self.steps: collections.deque = collections.deque(maxlen=window)
        self.slopes: collections.deque = collections.deque(maxlen=baseline + window)
        self.median, self.bound, self.refreshed = 0.0, math.inf, 0
        self.rising = 0        # consecutive steps the slope was above the baseline's bound
        self.since = 0         # the step the window of the first of them began at
        self.warned = False    # said once per episode of growth
        self.seen = 0


class AnomalyPrecursor(Rule):
    """An early warning: sustained growth of a precursor of divergence, before any NaN or loss spike.

    Per series of each signal of PRECURSORS (one module's largest attention logit, router entropy, update-to-weight
    ratio (judged at the steps the script logs the learning rate as the scalar `lr`) or weight norm; a falling
    signal as its inverse), on log values: its slope over the last `window` collected steps
    (the medians of the newer and older half joined), against the baseline of its own earlier slopes (after the
    first `warmup` values, the last BASELINE_SLOPES slopes of the steps before the window, taken once a window; at
    least BASELINE_MIN windows of them). A series warns when its slope has been, for
    `persist` steps in a row, above `factor` x the baseline's median, above that median plus `z` robust standard
    deviations of the baseline (1.4826 x MAD), and above `min_rate` (a growth of x(1 + min_rate) a step). Healthy
    training grows its weights and logits fastest early and ever slower; a run on its way to divergence grows them
    ever faster. A series warns once, until its growth has stopped for a window. The finding says which signal,
    since which step (where the window of the first rising slope began) and how fast: its value is the growth per
    step (x1.004: doubling in 174 steps; for a falling signal, the fall).

    Args:
        signals: the PRECURSORS to watch (default all: those the run records).
        window: collected steps a slope spans (default 10).
        warmup: values of a series before its slopes form the baseline (default 100: past a learning-rate warm-up and
            the fast changes of early training).
        factor: how many times the baseline's median slope a slope must exceed (default 3).
        z: robust standard deviations of the baseline's slopes a slope must exceed their median by (default 6).
        min_rate: the smallest growth per step that warns (default 0.002).
        persist: consecutive steps the slope must stay above its bound (default 5).
    """

    name = PRECURSOR_RULE

    def __init__(self, signals: Optional[Iterable[str]] = None, window: int = 10, warmup: int = 100,
                 factor: float = 3.0, z: float = 6.0, min_rate: float = 0.002, persist: int = 5):
        unknown = sorted(set(signals or ()) - set(PRECURSORS))
        if unknown:
            raise ValueError(f"AnomalyPrecursor signals {unknown} are not among {sorted(PRECURSORS)}")
        if window < 4:
            raise ValueError(f"AnomalyPrecursor window ({window}) must be at least 4")
        self.signals = {name: PRECURSORS[name] for name in (signals or PRECURSORS)}
        self.window, self.warmup, self.factor, self.z = window, warmup, factor, z
        self.min_rate, self.persist = math.log1p(min_rate), persist
        self._series: dict[tuple, _Series] = {}
        self._found: list[tuple[str, str, float]] = []
        self._step: Optional[int] = None
        self._lr: Optional[float] = None
        self._updates: list[tuple[str, float]] = []  # (tag, Adam's step over the weight) of the running step

    def begin_step(self, records, step=None, keys=None) -> None:
        self._step, self._lr, self._updates = step, None, []
        if step is None or keys is None:
            return
        weights = {}
        if "update_ratio" in self.signals:
            weights = {key.name: ops.get("norm") for key, (_, _, ops) in zip(keys, records)
                       if key.family == PARAM_UPDATED}
        for key, (tag, _, ops) in zip(keys, records):
            for signal_name, signal in self.signals.items():
                if key.family not in signal.families or not key.name.endswith(signal.endings) or \
                        (signal.matrices and len(key.shape) != 2):
                    continue
                value = next((ops[op] for op in signal.ops if ops.get(op) is not None), None)
                if signal_name != "update_ratio":
                    self._judge((signal_name, tag), signal, step, value)
                elif value is not None and weights.get(key.name):
                    self._updates.append((tag, value / weights[key.name]))  # judged with the step's lr

    def check_scalar(self, name, value) -> list:
        if name == LEARNING_RATE:
            self._lr = value
        return []

    def _judge(self, key: tuple, signal: Signal, step: int, value: Optional[float]) -> None:
        series = self._series.get(key)
        if value is None or not math.isfinite(value) or value <= 0:
            self._series.pop(key, None)  # no log: what came before is no baseline for what follows
            return
        if series is None:
            series = self._series[key] = _Series(self.window, BASELINE_SLOPES)
        series.logs.append(-math.log(value) if signal.falls else math.log(value))
        series.steps.append(step)
        series.seen += 1
        if series.seen < max(self.window, self.warmup):
            return
        slope = _slope(series.logs, series.steps)
        series.slopes.append(slope)
        if len(series.slopes) < self.window + BASELINE_MIN * self.window:
            return
        if series.seen >= series.refreshed + self.window:
            self._refresh(series)
        if slope <= series.bound:
            series.rising = 0
            series.warned = series.warned and slope > series.median  # its growth has stopped: it may warn again
            return
        if not series.rising:
            series.since = series.steps[0]  # where the window of the first rising slope began
        series.rising += 1
        if series.rising >= self.persist and not series.warned:
            series.warned = True
            rate = math.exp(-slope if signal.falls else slope)
            self._found.append((key[1], f"{key[0]} {'falling' if signal.falls else 'rising'} since step "
                                        f"{series.since}", rate))

    def _refresh(self, series: _Series) -> None:
        """The bound from the slopes before the window (the last BASELINE_SLOPES of them)."""
        baseline = list(series.slopes)[:-self.window]
        median = statistics.median(baseline)
        spread = statistics.median(abs(b - median) for b in baseline)
        series.median, series.refreshed = median, series.seen
        series.bound = max(self.min_rate, self.factor * max(median, 0.0), median + self.z * _MAD_TO_SIGMA * spread)

    def end_step(self) -> list[tuple[str, str, float]]:
        if self._lr is not None:
            for tag, ratio in self._updates:
                self._judge(("update_ratio", tag), PRECURSORS["update_ratio"], self._step, self._lr * ratio)
        found, self._found, self._updates = self._found, [], []
        return found


def _slope(logs, steps) -> float:
    """Growth per step: the medians of the newer and the older half of the window joined."""
    half = len(logs) // 2
    logs, steps = list(logs), list(steps)
    run = statistics.median(steps[-half:]) - statistics.median(steps[:half])
    return (statistics.median(logs[-half:]) - statistics.median(logs[:half])) / run if run > 0 else 0.0


RULES = {cls.name: cls for cls in (AnomalyNan, AnomalyTurbulence, AnomalySpike, AnomalyPrecursor)}


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
                             f"{cfg.rule_name} arguments in docs/guides/anomalies.md") from None
    return rules
