"""What the daemon's TensorBoard view holds: a bounded set of tags, whatever the ranks, micro-steps or calls.

- `Overview/`: the first screen (`headline`): the loss, grad norm, learning rate, loss scale and the weights'
  global norm, the NaN and Inf elements, the (tensor, rank) pairs holding one, the rank of the first of them (the
  layer in the chart's name) and the stalled ranks; as text, the place of the first NaN/Inf, written once.
- `Worst tensor/`: per family the largest `<op>` (norm by default) and the largest |value| of any one tensor and rank
  (`<family> <op>`, `<family> absmax`: a single tensor's, not a global norm), and per one-value family value its
  worst over the model. The model output's grad when it is exactly 1 (dL/dL: the forward returns the loss) is left
  out: a constant is no signal.
- `<family>/`: one chart per layer (`<family>/<op> of <layer>`: the layer's tensors reduced, the largest across
  tensors and ranks), and the family's NaN and Inf elements. Collectives are layers of their own, one per op and
  group, named by the group's role (`all_reduce@dp`, `send@pp`) from the ranks' `parallel` metadata.
- One-value families (L2 features, MoE load; `trainmon.core.feature_table`): per value one chart per layer,
  `<family>/<value> of <layer>`; not the generic per-op charts, which would mix the values of a module. The tokens of
  each expert (`moe_expert_load`) are drawn as a heatmap only.
- `scalars/<name>`: the other logged scalars; with more than one rank `scalars/<name>/{min,median,max}`, the spread
  across ranks of every logged scalar.
- What the user selects: `detail/<family>/<tensor>/<op>` for every tensor whose name matches a `--detail`
  pattern (with more than one rank the cross-rank min/median/max and the rank of the max), and every figure
  of the `--ranks` ranks as `rank<R>/...`.

The runs (TensorBoard names a run by its directory, and draws a line per run in each chart): `max` holds every tag;
with more than one rank, `min` and `median` hold the layer charts' tags, each rank's layer value (the largest of its
tensors) reduced over ranks, so each layer chart draws the min, median and max over ranks; `nonfinite_elements` holds,
in each layer chart, the layer's NaN and Inf elements over its tensors and ranks at the steps that have some, so that
a failure is drawn in the chart of the layer where it is, whatever the axis.
Reductions follow the figures: NaN wins, then +Inf, so a failure is never hidden behind a finite value.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

from trainmon.core import feature_table
from trainmon.core.collective_ops import parse_comm_name
from trainmon.core.records import ACTV_GRAD, COMM, FEATURE_FAMILIES
from trainmon.watch.aggregate import (MAX_RANK, SCALARS, StepFigures, cross_rank, family_rank, label_of, layer_of,
                                      tag_base, worst)
from trainmon.watch.headline import (FIRST_NONFINITE_RANK_TAG, INF_ELEMENTS, NAN_ELEMENTS, OVERVIEW,
                                     STALLED_RANKS_TAG, TENSORS_NONFINITE, Headline, headline_names)

WORST = "Worst tensor"  # sorts after Overview ("W" > "O") and before the families (lower case)
DETAIL = "detail"
# The runs: the layer charts' spread over ranks and their NaN/Inf elements go into sibling runs of MAX_RUN, so that
# TensorBoard draws them in the same chart, and the tags stay one per layer.
MAX_RUN = "max"
SPREAD_STATS = ("min", "median")
NONFINITE_RUN = "nonfinite_elements"
# The model's own output: its grad is dL/dL = 1 where the forward returns the loss
_MODEL_OUTPUT = re.compile(r"^\.output(_\d+)?$")


def layer_tag(family: str, layer: str, what: str) -> str:
    """The tag of a layer's chart of `what` (an op, or a one-value family's value)."""
    return f"{family}/{what} of {layer}"


def worst_tag(family: str, what: str) -> str:
    return f"{WORST}/{family} {what}"


class GroupRoles:
    """Names process groups by their role (`dp`, `tp`, `pp`, `ep`, ...) from the ranks' `parallel` metadata
    (a role is any entry holding `ranks`), the whole world as `world`, a group of one rank as `self`, else by
    their size."""

    def __init__(self, metadata: Iterable[dict] = ()):
        self.roles: dict[frozenset, str] = {}
        self.world = 0
        for meta in metadata:
            self.add(meta)

    def add(self, meta: dict) -> None:
        parallel = meta.get("parallel") or {}
        self.world = max(self.world, int(meta.get("world_size") or 0))
        for role, entry in parallel.items():
            if isinstance(entry, dict) and isinstance(entry.get("ranks"), list) and len(entry["ranks"]) > 1:
                self.roles.setdefault(frozenset(entry["ranks"]), role)

    def name(self, ranks: list[int], p2p: bool) -> str:
        group = frozenset(ranks)
        if p2p:  # a pair of pipeline neighbours: the role of a group holding both
            return next((role for members, role in self.roles.items() if group <= members), "p2p")
        if group in self.roles:
            return self.roles[group]
        if len(group) == 1:
            return "self"  # every role of size 1 is this group: which one called is not known
        return "world" if self.world and len(group) == self.world else f"{len(group)}ranks"


@dataclass
class ViewOptions:
    """What the view shows beside its fixed part.

    Args:
        op: the op of the layer charts and the overview's largest value per family.
        detail: regular expressions: tensors whose name matches one get charts of their own.
        single_rank: the run has one rank (one value instead of a cross-rank spread).
        roles: the collectives' group names.
    """

    op: str = "norm"
    detail: tuple = ()
    single_rank: bool = False
    roles: GroupRoles = field(default_factory=GroupRoles)

    def __post_init__(self):
        self._patterns = [re.compile(p) for p in self.detail]
        self._layers: dict[tuple, str] = {}  # the same tensors come back every step

    def selected(self, name: str) -> bool:
        return any(p.search(name) for p in self._patterns)

    def layer(self, family: str, name: str, vpp: int) -> str:
        """The layer a tensor's chart belongs to; collectives by op and group role, not by call."""
        key = (family, name, vpp)
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = self._layer(family, name, vpp)
        return found

    def _layer(self, family: str, name: str, vpp: int) -> str:
        if family == COMM:
            parsed = parse_comm_name(name)
            if parsed is not None:
                return f"{parsed['op']}@{self.roles.name(parsed['ranks'], 'src' in parsed)}"
        layer = layer_of(name)
        return f"{vpp}:{layer}" if vpp else layer


@dataclass
class StepTags:
    """What one step writes: the tags of MAX_RUN, those of each sibling run, and the texts."""

    scalars: list[tuple[str, float]]
    siblings: dict[str, list[tuple[str, float]]]
    texts: list[tuple[str, str]]


class View:
    """Turns each exported step's figures into tags; keeps the state that spans steps (the headline's incident, the
    layer charts that held a NaN/Inf).

    Args:
        options: what it shows.
        state: `state()` of an earlier daemon on the same log directory.
    """

    def __init__(self, options: ViewOptions, state: Optional[dict] = None):
        self.options = options
        state = state or {}
        self.headline = Headline(options.layer, state.get("headline"))
        self.nonfinite_charts: set[str] = set(state.get("nonfinite_charts", []))  # the layer charts NONFINITE_RUN draws

    def state(self) -> dict:
        return {"headline": self.headline.state(), "nonfinite_charts": sorted(self.nonfinite_charts)}

    def tags(self, figure: StepFigures, stalled: int = 0) -> StepTags:
        scalars = self.headline.values(figure, stalled) + self._worst_tensors(figure) + self._layers(figure)
        scalars += self._features(figure) + self._scalars(figure) + self._detail(figure) + self._ranks(figure)
        return StepTags(scalars, self._siblings(figure), self.headline.texts(figure))

    # --------------------------------------------------------------------------------------- parts
    def _worst_tensors(self, figure: StepFigures) -> list[tuple[str, float]]:
        op = self.options.op
        largest: dict[str, list] = {}
        extremes: dict[str, list] = {}
        for (family, name, vpp, key_op), (low, _, high, _) in figure.stats.items():
            if family in FEATURE_FAMILIES or key_op not in (op, "min", "max"):
                continue  # one-value families: summarised per value (`_features`)
            if family == ACTV_GRAD and _is_loss_grad(figure, name, vpp):
                continue
            if key_op == op:
                largest.setdefault(family, []).append(high)
            else:
                extremes.setdefault(family, []).append(abs(high) if key_op == "max" else abs(low))
                if key_op == "min" and high != high:  # a NaN min on some rank
                    extremes[family].append(math.nan)
        out = []
        for family in sorted(set(largest) | set(extremes), key=family_rank):
            if family in largest:
                out.append((worst_tag(family, op), worst(largest[family])))
            if family in extremes:
                out.append((worst_tag(family, "absmax"), worst(extremes[family])))
        return out

    def _layers(self, figure: StepFigures) -> list[tuple[str, float]]:
        op = self.options.op
        layers: dict[tuple[str, str], list] = {}
        families = set()
        for (family, name, vpp, key_op), (_, _, high, _) in figure.stats.items():
            if family in FEATURE_FAMILIES:
                continue  # per value, not per op (`_features`)
            families.add(family)
            if key_op == op:
                layers.setdefault((family, self.options.layer(family, name, vpp)), []).append(high)
        out = [(layer_tag(family, layer, op), worst(values)) for (family, layer), values in layers.items()]
        for family in families:
            nans, infs = figure.nonfinite_elements.get(family, (0.0, 0.0))
            out += [(f"{family}/{NAN_ELEMENTS}", nans), (f"{family}/{INF_ELEMENTS}", infs)]
        return out

    def _features(self, figure: StepFigures) -> list[tuple[str, float]]:
        """Per one-value family, value and layer: the worst over the layer's modules and the ranks; per value, its
        worst over the model. A value is its record's max (= min = mean), or |value| (norm) where the run's ops have
        neither."""
        layers: dict[tuple, list] = {}
        for (family, name, vpp, key_op), (low, _, high, _) in figure.stats.items():
            if family not in feature_table.VALUES:
                continue
            module, _, value = name.rpartition(".")
            low_worse = feature_table.low_is_worse(family, value)
            wanted = ("min" if low_worse else "max", "norm")
            if key_op not in wanted or (key_op == "norm" and (family, name, vpp, wanted[0]) in figure.stats):
                continue
            layers.setdefault((family, self.options.layer(family, module, vpp), value, low_worse), []).append(
                low if low_worse else high)
        out, model = [], {}
        for (family, layer, value, low_worse), values in layers.items():
            worst_here = -worst(-v for v in values) if low_worse else worst(values)
            out.append((layer_tag(family, layer, value), worst_here))
            model.setdefault((family, value, low_worse), []).append(worst_here)
        for (family, value, low_worse), values in model.items():
            out.append((worst_tag(family, value), -worst(-v for v in values) if low_worse else worst(values)))
        return out

    def _siblings(self, figure: StepFigures) -> dict[str, list[tuple[str, float]]]:
        """Per sibling run, its values of the layer charts: per stat of SPREAD_STATS each rank's layer value (the
        largest of its tensors) reduced over ranks (none with one rank); NONFINITE_RUN the layers' NaN and Inf
        elements, in each layer chart from its first NaN/Inf on (0 at a step without: TensorBoard would draw a line
        across the steps between two failures), and in the headline's charts (loss, norms) the ranks where that
        value is NaN or Inf (TensorBoard draws a NaN at the last finite value, where it reads as a flat line)."""
        op = self.options.op
        out: dict[str, list] = {stat: [] for stat in SPREAD_STATS} if figure.layer_spread else {}
        for (family, layer), (low, median, _, _) in figure.layer_spread.items():
            if family in FEATURE_FAMILIES:
                continue  # a value per layer, the worst over ranks (`_features`)
            tag = layer_tag(family, layer, op)
            out["min"].append((tag, low))
            out["median"].append((tag, median))
        elements: dict[str, float] = {}
        for (family, name, vpp), count in figure.nonfinite_by_tensor.items():
            if family not in FEATURE_FAMILIES:
                tag = layer_tag(family, self.options.layer(family, name, vpp), op)
                elements[tag] = elements.get(tag, 0.0) + count
        series = figure.scalar_series()  # the headline's loss and norms: the ranks where they are NaN or Inf
        for name in headline_names(series):
            ranks = sum(1 for value in series[name].values() if not math.isfinite(value))
            if ranks:
                elements[f"{OVERVIEW}/{name}"] = float(ranks)
        self.nonfinite_charts |= elements.keys()
        if self.nonfinite_charts and figure.recorded:
            out[NONFINITE_RUN] = [(tag, elements.get(tag, 0.0)) for tag in sorted(self.nonfinite_charts)]
        return out

    def _scalars(self, figure: StepFigures) -> list[tuple[str, float]]:
        """The logged scalars the headline does not show; with more than one rank, every one's spread."""
        series = figure.scalar_series()
        if self.options.single_rank:
            shown = set(headline_names(series))
            return [(f"{SCALARS}/{name}", worst(by_rank.values())) for name, by_rank in series.items()
                    if name not in shown]
        out = []
        for name, by_rank in series.items():
            low, median, high, _ = cross_rank(by_rank)
            out += [(f"{SCALARS}/{name}/min", low), (f"{SCALARS}/{name}/median", median),
                    (f"{SCALARS}/{name}/max", high)]
        return out

    def _detail(self, figure: StepFigures) -> list[tuple[str, float]]:
        if not self.options.detail:
            return []
        out = []
        for (family, name, vpp, op), (low, median, high, high_rank) in figure.stats.items():
            if not self.options.selected(name):
                continue
            base = f"{DETAIL}/{family}/{label_of(name, vpp)}/{op}"
            if self.options.single_rank:
                out.append((base, high))
            else:
                out += [(f"{base}_min", low), (f"{base}_median", median), (f"{base}_max", high),
                        (f"{base}_{MAX_RANK}", float(high_rank))]
        return out

    @staticmethod
    def _ranks(figure: StepFigures) -> list[tuple[str, float]]:
        out = []
        for (rank, family, name, vpp, micro, op), value in figure.per_rank.items():
            suffix = "" if micro is None else f":{micro}"
            out.append((f"rank{rank}/{tag_base(family, name, vpp)}{suffix}/{op}", value))
        kept = {key[0] for key in figure.per_rank}
        for name, by_rank in figure.scalar_series().items():
            out += [(f"rank{rank}/{SCALARS}/{name}", value) for rank, value in sorted(by_rank.items()) if rank in kept]
        return out


def _is_loss_grad(figure: StepFigures, name: str, vpp: int) -> bool:
    """Whether a grad is the model output's and exactly 1 in every figure: dL/dL, where the forward returns the
    loss."""
    if not _MODEL_OUTPUT.match(name):
        return False
    figures = [figure.stats.get((ACTV_GRAD, name, vpp, op)) for op in ("min", "max", "norm")]
    figures = [f for f in figures if f is not None]
    return bool(figures) and all(f[0] == 1.0 and f[2] == 1.0 for f in figures)


def layout(scalar_names: Iterable[str], families: Iterable[str], op: str, single_rank: bool,
           detail_keys: Iterable[tuple]) -> dict[str, list]:
    """The custom-scalars layout: the headline first (the only category open), the worst tensor per family and
    their NaN and Inf elements, one category per family, the scalars' spread across ranks, and the selected
    tensors' largest value per family and op. Each chart is ("multiline", title, [tag regexes]) or ("margin", title,
    median, low, high)."""
    families = sorted(families, key=family_rank)
    overview = [("multiline", name, [rf"^{OVERVIEW}/{re.escape(name)}$"]) for name in headline_names(scalar_names)]
    overview += [("multiline", "NaN and Inf elements", [rf"^{OVERVIEW}/({NAN_ELEMENTS}|{INF_ELEMENTS})$"]),
                 ("multiline", "tensors holding a NaN or Inf (x ranks)", [rf"^{OVERVIEW}/{TENSORS_NONFINITE}$"]),
                 ("multiline", "rank of the first NaN/Inf", [rf"^{re.escape(FIRST_NONFINITE_RANK_TAG)} "]),
                 ("multiline", "stalled ranks", [rf"^{re.escape(STALLED_RANKS_TAG)}$"])]
    worst_charts = [("multiline", f"largest {op} of a tensor, per family", [rf"^{WORST}/[^/]+ {op}$"]),
                    ("multiline", "largest |value| of a tensor, per family", [rf"^{WORST}/[^/]+ absmax$"]),
                    ("multiline", "NaN elements per family", [rf"^(?!{OVERVIEW}/)[^/]+/{NAN_ELEMENTS}$"]),
                    ("multiline", "Inf elements per family", [rf"^(?!{OVERVIEW}/)[^/]+/{INF_ELEMENTS}$"])]
    out = {OVERVIEW: overview, WORST: worst_charts}
    for family in families:
        if family in feature_table.VALUES:
            worst_charts.append(("multiline", f"{family}: worst per value", [rf"^{WORST}/{re.escape(family)} "]))
            out[family] = [("multiline", f"{family}: {value} per layer",
                            [rf"^{re.escape(layer_tag(family, '', value))}[^/]+$"])
                           for value in feature_table.names(family)]
        elif family not in FEATURE_FAMILIES:
            out[family] = [("multiline", f"{family}: {op} per layer",
                            [rf"^{re.escape(layer_tag(family, '', op))}[^/]+$"])]
    if not single_rank:
        out[SCALARS] = [("margin", name, f"{SCALARS}/{name}/median", f"{SCALARS}/{name}/min", f"{SCALARS}/{name}/max")
                        for name in sorted(scalar_names)]
    # one chart per family and op, every selected tensor a line in it: a custom-scalars chart costs a pass over
    # the whole run in TensorBoard, whatever it matches
    suffix = "" if single_rank else "_max"
    for family, key_op in sorted({(key[0], key[3]) for key in detail_keys}):
        out.setdefault(f"{DETAIL} {family}", []).append(
            ("multiline", f"{family} {key_op}{suffix}", [rf"^{DETAIL}/{re.escape(family)}/.*/{key_op}{suffix}$"]))
    return out
