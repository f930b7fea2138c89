"""What the daemon's TensorBoard view holds: a bounded set of tags, whatever the ranks, micro-steps or calls.

- `Overview/`: the first screen. The logged scalars and the global grad norm (the largest across ranks), per
  family the largest `<op>` (norm by default) and the largest |value| over every tensor and rank, the NaN and
  Inf elements, the (tensor, rank) pairs holding one, the rank of the first of them, and the stalled ranks.
  The place of the first NaN/Inf is written as text (`Overview/first_nonfinite`) whenever it changes.
- `<family>/`: one chart per layer (`<family>/<layer>/<op>`: the layer's tensors reduced, the largest across
  tensors and ranks), and the family's NaN and Inf elements. With more than one rank, the sibling runs
  `ranks_min` and `ranks_median` hold the same tags: each rank's layer value (the largest of its tensors)
  reduced over ranks, so each layer chart draws the min, median and max over ranks. Collectives are layers
  of their own, one per op and group, named by the group's role (`all_reduce@dp`, `send@pp`) from the
  ranks' `parallel` metadata.
- One-value families (L2 features, MoE load; `trainmon.core.feature_table`): per value one chart per layer,
  `<family>/<layer>/<value>`, and its worst over the model, `Overview/<family>_<value>_{max|min}`: the largest, or the
  smallest where a fall is the failure (an entropy collapsing); not the generic per-op charts, which would mix the
  values of a module. The tokens of each expert (`moe_expert_load`) are drawn as a heatmap only.
- `scalars/<name>/{min,median,max}`: the spread across ranks of each logged scalar (more than one rank only).
- What the user selects: `detail/<family>/<tensor>/<op>` for every tensor whose name matches a `--detail`
  pattern (with more than one rank the cross-rank min/median/max and the rank of the max), and every figure
  of the `--ranks` ranks as `rank<R>/...`.
Reductions follow the figures: NaN wins, then +Inf, so a failure is never hidden behind a finite value.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

from trainmon.core import feature_table
from trainmon.core.collective_ops import parse_comm_name
from trainmon.core.records import COMM, FEATURE_FAMILIES
from trainmon.watch.aggregate import (MAX_RANK, SCALARS, StepFigures, cross_rank, family_rank, label_of, layer_of,
                                      tag_base)

OVERVIEW = "Overview"  # capitalised: TensorBoard sorts tag groups by code point, so it comes first
DETAIL = "detail"
NAN_ELEMENTS, INF_ELEMENTS = "nan_elements", "inf_elements"
FIRST_NONFINITE_TAG = f"{OVERVIEW}/first_nonfinite"
# The layer charts' spread over ranks goes into sibling runs of these names: TensorBoard then draws the min
# and the median in the same chart as the max (this run), and the tags stay one per layer.
SPREAD_RUN = "ranks_"
SPREAD_STATS = ("min", "median")


def worst(values: Iterable[float]) -> float:
    """The largest value, NaN if any is NaN (NaN when there is none)."""
    out = -math.inf
    seen = False
    for value in values:
        if value != value:
            return math.nan
        seen = True
        out = value if value > out else out
    return out if seen else math.nan


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


class View:
    """Turns each exported step's figures into (tag, value) pairs; keeps the state that spans steps (the last
    place of the first NaN/Inf)."""

    def __init__(self, options: ViewOptions):
        self.options = options
        self.first_nonfinite: Optional[tuple] = None

    def tag_values(self, figure: StepFigures, stalled: int = 0) -> list[tuple[str, float]]:
        out = self._overview(figure, stalled) + self._layers(figure) + self._features(figure) + self._spread(figure)
        out += self._detail(figure) + self._ranks(figure)
        return out

    def texts(self, figure: StepFigures) -> list[tuple[str, str]]:
        """(tag, markdown) to write at this step: the first NaN/Inf's place, when it moved."""
        if figure.worst is None or figure.worst == self.first_nonfinite:
            return []
        self.first_nonfinite = figure.worst
        family, name, vpp, rank = figure.worst
        elements = figure.nonfinite_elements.get(family, (0.0, 0.0))
        return [(FIRST_NONFINITE_TAG,
                 f"step {figure.step}: first NaN/Inf in **{self.options.layer(family, name, vpp)}** "
                 f"({family} `{label_of(name, vpp)}`) on rank {rank}. This step: {figure.tensors_nonfinite} "
                 f"tensor(s) hold a NaN or Inf over all ranks; {family} holds {elements[0]:.0f} NaN and "
                 f"{elements[1]:.0f} Inf elements")]

    # --------------------------------------------------------------------------------------- parts
    def _overview(self, figure: StepFigures, stalled: int) -> list[tuple[str, float]]:
        op = self.options.op
        out = [(f"{OVERVIEW}/{name}", worst(by_rank.values())) for name, by_rank in figure.scalar_series().items()]
        largest: dict[str, list] = {}
        extremes: dict[str, list] = {}
        for (family, _, _, key_op), (low, _, high, _) in figure.stats.items():
            if family in FEATURE_FAMILIES:
                continue  # summarised per value (`_features`)
            if key_op == op:
                largest.setdefault(family, []).append(high)
            elif key_op in ("min", "max"):
                extremes.setdefault(family, []).append(abs(high) if key_op == "max" else abs(low))
                if key_op == "min" and high != high:  # a NaN min on some rank
                    extremes[family].append(math.nan)
        for family in sorted(set(largest) | set(extremes), key=family_rank):
            if family in largest:
                out.append((f"{OVERVIEW}/{family}_{op}_max", worst(largest[family])))
            if family in extremes:
                out.append((f"{OVERVIEW}/{family}_absmax", worst(extremes[family])))
        if figure.recorded:  # a step without records has no count to show, not a count of 0
            counts = figure.nonfinite_elements.values()
            out += [(f"{OVERVIEW}/{NAN_ELEMENTS}", sum(c[0] for c in counts)),
                    (f"{OVERVIEW}/{INF_ELEMENTS}", sum(c[1] for c in counts)),
                    (f"{OVERVIEW}/tensors_nonfinite", float(figure.tensors_nonfinite))]
        out.append((f"{OVERVIEW}/stalled_ranks", float(stalled)))
        if figure.worst is not None:
            out.append((f"{OVERVIEW}/first_nonfinite_rank", float(figure.worst[3])))
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
        out = [(f"{family}/{layer}/{op}", worst(values)) for (family, layer), values in layers.items()]
        for family in families:
            nans, infs = figure.nonfinite_elements.get(family, (0.0, 0.0))
            out += [(f"{family}/{NAN_ELEMENTS}", nans), (f"{family}/{INF_ELEMENTS}", infs)]
        return out

    def _features(self, figure: StepFigures) -> list[tuple[str, float]]:
        """Per one-value family, value and layer: the worst over the layer's modules and the ranks; per value, its
        worst over the model in the overview. A value is its record's max (= min = mean), or |value| (norm) where
        the run's ops have neither."""
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
            out.append((f"{family}/{layer}/{value}", worst_here))
            model.setdefault((family, value, low_worse), []).append(worst_here)
        for (family, value, low_worse), values in model.items():
            out.append((f"{OVERVIEW}/{family}_{value}_{'min' if low_worse else 'max'}",
                        -worst(-v for v in values) if low_worse else worst(values)))
        return out

    def spread_values(self, figure: StepFigures) -> dict[str, list[tuple[str, float]]]:
        """Per stat of SPREAD_STATS, the layer charts' values over ranks: each rank's layer value (the largest of
        its tensors) reduced over ranks. Empty with one rank."""
        out: dict[str, list] = {stat: [] for stat in SPREAD_STATS} if figure.layer_spread else {}
        for (family, layer), (low, median, _, _) in figure.layer_spread.items():
            if family in FEATURE_FAMILIES:
                continue  # a value per layer, the worst over ranks (`_features`)
            tag = f"{family}/{layer}/{self.options.op}"
            out["min"].append((tag, low))
            out["median"].append((tag, median))
        return out

    def _spread(self, figure: StepFigures) -> list[tuple[str, float]]:
        if self.options.single_rank:
            return []
        out = []
        for name, by_rank in figure.scalar_series().items():
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


def layout(scalar_names: Iterable[str], families: Iterable[str], op: str, single_rank: bool,
           detail_keys: Iterable[tuple]) -> dict[str, list]:
    """The custom-scalars layout: `Overview` first (per family in one chart each: the largest `op`, NaN and
    Inf elements), the scalars' spread across ranks, and the selected tensors' largest value per family and op.
    Each chart is ("multiline", title, [tag regexes]) or ("margin", title, median, low, high)."""
    families = sorted(families, key=family_rank)
    overview = [("multiline", f"largest {op} per family", [rf"^{OVERVIEW}/.*_{op}_max$"]),
                ("multiline", "largest |value| per family", [rf"^{OVERVIEW}/.*_absmax$"]),
                ("multiline", "NaN elements per family", [rf"^[^/]+/{NAN_ELEMENTS}$"]),
                ("multiline", "Inf elements per family", [rf"^[^/]+/{INF_ELEMENTS}$"])]
    out = {OVERVIEW: overview}
    for family in families:
        if family in feature_table.VALUES:
            overview.append(("multiline", f"{family}: worst per value", [rf"^{OVERVIEW}/{re.escape(family)}_"]))
            out[family] = [("multiline", f"{family}: {value} per layer", [rf"^{re.escape(family)}/[^/]+/{value}$"])
                           for value in feature_table.names(family)]
        elif family not in FEATURE_FAMILIES:
            out[family] = [("multiline", f"{family}: {op} per layer", [rf"^{re.escape(family)}/[^/]+/{op}$"])]
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

