"""One anomaly: where it was seen (its place in the ordering key), what tensor it was, which rule fired.

Names: a record's `RecordKey.name` is split into `module` and `tensor`.
- Activations (`actv`): `<module>.<leaf>` -> module `<module>`, tensor `input`, `input_<i>`, `output`,
  `output_<i>` (`<module>#<k>` for the k-th extra call of a module in one micro-step; the root module
  is `""`).
- Activation grads (`actv_grad`): the same split, tensor `grad_input[_<i>]` (the grads the module's
  backward computed) or `grad_output[_<i>]` (the grads that reached it).
- Parameter families: module is the parameter name (`layers.0.mlp.0.weight`), tensor is named by the
  family: `grad` (before the reduction), `reduced_grad`, `param`, `updated_param`, `exp_avg`,
  `exp_avg_sq`, `adam_update`, `adam_ratio`, `mg_direction`.
- Feature families (`attention_hook`, `linear_hook`, `moe_router_*_hook`, `moe_load`, `moe_expert_load`):
  `<module>.<feature>` -> module `<module>`, tensor the feature (`entropy`, `kernel_norm`, `imbalance`, ...).
- Any other family (e.g. collectives) keeps the whole name as module and the family as tensor.
"""
from __future__ import annotations

import math
import typing
from dataclasses import asdict, dataclass, fields
from typing import Optional

from trainmon.core import ordering
from trainmon.core.records import (ACTV, ACTV_GRAD, ADAM_RATIO, ADAM_UPDATE, EXP_AVG, EXP_AVG_SQ,
                                      FEATURE_FAMILIES, GRAD_REDUCED, GRAD_UNREDUCED, MG_DIRECTION, PARAM_ORIGIN,
                                      PARAM_UPDATED, PHASES)


PARAM_TENSORS = {
    GRAD_UNREDUCED: "grad",
    GRAD_REDUCED: "reduced_grad",
    PARAM_ORIGIN: "param",
    PARAM_UPDATED: "updated_param",
    EXP_AVG: "exp_avg",
    EXP_AVG_SQ: "exp_avg_sq",
    ADAM_UPDATE: "adam_update",
    ADAM_RATIO: "adam_ratio",
    MG_DIRECTION: "mg_direction",
}
SCALAR_PHASE = "scalar"  # anomalies of values given to `log_scalar`
SENTINEL_RULE = "sentinel"
PRECURSOR_RULE = "AnomalyPrecursor"  # its finding's op names the signal and since when, its value the rate
# What the sentinel found (its event's `op`; `monitor.sentinel.verdict`), with the event's value: INF is an
# Inf whose sign was not probed (weights). "nonfinite" is the op of older runs, whose value is the probe.
NAN, POS_INF, NEG_INF, BOTH_INF, INF = "nan", "+inf", "-inf", "+inf/-inf", "inf"
SENTINEL_VALUES = {NAN: math.nan, POS_INF: math.inf, NEG_INF: -math.inf, BOTH_INF: math.inf, INF: math.inf}


def split_name(family: str, name: str) -> tuple[str, str]:
    """(module, tensor) of a record name; see the module docstring."""
    if family in (ACTV, ACTV_GRAD):
        module, _, leaf = name.rpartition(".")
        return module, (f"grad_{leaf}" if family == ACTV_GRAD else leaf)
    if family in FEATURE_FAMILIES:
        module, _, feature = name.rpartition(".")
        return module, feature
    return name, PARAM_TENSORS.get(family, family)


def phase_of(family: str) -> str:
    return PHASES.get(family, family)


@dataclass(frozen=True, slots=True)
class AnomalyEvent:
    """One anomalous record; `first` marks the earliest of its rank's step."""

    rank: int
    step: int
    micro_step: Optional[int]
    pp_stage: int
    vpp_stage: int
    call_index: Optional[int]
    module: str
    phase: str
    tensor: str
    op: str
    value: float
    rule: str
    family: str
    first: bool = False

    def __reduce__(self):
        # positional arguments: unpickling (ranks' summaries come from worker processes) calls __init__
        # once instead of the per-field __setstate__ of a frozen slotted dataclass
        return AnomalyEvent, tuple(getattr(self, name) for name in self.__slots__)

    def order_key(self) -> tuple:
        """The ordering key (`ordering.order_key`): sort by it, earliest first."""
        return ordering.order_key(self)

    @property
    def nonfinite(self) -> bool:
        """Whether the anomaly is a NaN/Inf (not a spike or a threshold crossing)."""
        return self.op in ("nans", "infs", "nonfinite") or not math.isfinite(self.value)

    def where(self) -> dict:
        """The location fields used in reports: rank, step, micro_step, module, phase, tensor, call_index."""
        return {"rank": self.rank, "step": self.step, "micro_step": self.micro_step, "module": self.module,
                "phase": self.phase, "tensor": self.tensor, "call_index": self.call_index}

    def describe(self) -> str:
        micro = "" if self.micro_step is None else f" micro-step {self.micro_step}"
        call = "" if self.call_index is None else f", call {self.call_index}"
        origin = f" - {INPUT_BATCH_ORIGIN}" if came_with_input_batch(self.where()) else ""
        return (f"rank {self.rank} step {self.step}{micro}: {self.module or '<root>'} {self.phase} "
                f"{self.tensor} ({self.rule}: {finding(self.op, self.value, self.rule)}{call}){origin}")

    def to_json(self) -> dict:
        """A JSON-safe dict; NaN and ±Inf values are written as the strings "nan", "inf", "-inf"."""
        out = asdict(self)
        out["value"] = self.value if math.isfinite(self.value) else str(self.value)
        return out

    @classmethod
    def from_json(cls, data: dict) -> "AnomalyEvent":
        """Inverse of `to_json`; raises ValueError naming a missing or mistyped field."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data and n != "first"]
        if missing:
            raise ValueError(f"missing field(s) {', '.join(missing)}")
        for name, kinds in _FIELD_TYPES.items():
            if not isinstance(data[name], kinds) or isinstance(data[name], bool):
                raise ValueError(f"field {name!r} = {data[name]!r} has the wrong type")
        try:
            value = float(data["value"])
        except (TypeError, ValueError):
            raise ValueError(f"field 'value' = {data['value']!r} is not a number") from None
        return cls(**{n: data[n] for n in names if n in data} | {"value": value, "first": bool(data.get("first"))})


# The event's fields in order, with their types: the JSON reader, the database table (writers.db_schema) and its
# rows (writers.anomaly_table) take them from here.
EVENT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(AnomalyEvent))
EVENT_TYPES: dict[str, type] = {name: hint for name, hint in typing.get_type_hints(AnomalyEvent).items()
                                if name in EVENT_FIELDS}


def _json_types(hint) -> tuple:
    """The Python types a JSON value of a field may have (Optional[int]: int or None)."""
    return typing.get_args(hint) or (hint,)


_FIELD_TYPES = {name: _json_types(hint) for name, hint in EVENT_TYPES.items() if name not in ("value", "first")}


INPUT_BATCH_ORIGIN = "it came in with the input batch: no module produced it (look at the data)"


def came_with_input_batch(where: dict) -> bool:
    """Whether a place (`AnomalyEvent.where()`) is the model's own input in forward: a value no module made."""
    return where["module"] == "" and where["phase"] == "forward" and where["tensor"].startswith("input")


def finding(op: str, value, rule: str) -> str:
    """`op=value` as reports write it; the sentinel's `nonfinite=<what it found>` (nan, +inf, -inf, +inf/-inf)."""
    if rule == SENTINEL_RULE and op in SENTINEL_VALUES:
        return f"nonfinite={op}"
    if rule == PRECURSOR_RULE and isinstance(value, float) and value > 0 and value != 1:
        doubling = math.log(2) / abs(math.log(value))
        return f"{op}, x{value:.4g} a step ({'halves' if value < 1 else 'doubles'} in {doubling:.0f} steps)"
    return f"{op}={value if isinstance(value, str) else format(value, '.6g')}"
