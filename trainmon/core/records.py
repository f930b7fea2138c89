"""Typed records that flow from the hooks to the writer thread."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import numpy as np

from trainmon.core.schema import N_FIELDS, merge_rows

# Families, in the order msprobe writes them. The value is the CSV file prefix.
ACTV = "actv"
ACTV_GRAD = "actv_grad"
# Module inputs/outputs of evaluation forwards (`eval_xy_distribution`); micro_step numbers the evaluation
# pass, and step is the last optimizer step applied before it.
ACTV_EVAL = "actv_eval"
GRAD_UNREDUCED = "grad_unreduced"
GRAD_REDUCED = "grad_reduced"
PARAM_ORIGIN = "param_origin"
PARAM_UPDATED = "param_updated"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
ADAM_UPDATE = "adam_update"
ADAM_RATIO = "adam_ratio"
MG_DIRECTION = "mg_direction"
# Inputs/outputs of torch.distributed collectives and p2p ops (cc_distribution). A record's name is
# `<op>[<group ranks>]@<group name>#<seq>.<input|output>[_<i>]` (p2p: `<op>[<src>-><dst>]@...`), see
# trainmon.core.collective_ops.parse_comm_name.
COMM = "comm"
# Variables of the training script given to `trainmon.save` (their values, in forward) and `trainmon.save_grad`
# (their grads, in backward); a record's name is the one the script gave (see trainmon.hooks.saved).
SAVE = "save"
SAVE_GRAD = "save_grad"
# msprobe's L2 features (`recording_l2_features`, `l2_targets`), one family per hook of `l2_targets`, named as
# msprobe names its CSV files. A record's name is `<module>.<feature>` (e.g. `layers.0.attn.core.entropy`), and
# its value is the record of a one-element tensor: min = max = mean = the feature (trainmon.hooks.features).
ATTENTION_HOOK = "attention_hook"
LINEAR_HOOK = "linear_hook"
MOE_ROUTER_WEIGHT_HOOK = "moe_router_weight_hook"
MOE_ROUTER_LOGIT_HOOK = "moe_router_logit_hook"
# Mixture-of-experts routing per layer and step (`moe_load`), merged over the expert-parallel group: per router
# `<router>.imbalance`, `.idle_experts`, `.dropped_tokens`, `.router_entropy` in MOE_LOAD and the tokens of each
# expert, `<router>.expert_<e>`, in MOE_EXPERT_LOAD; one-element records like the features'.
MOE_LOAD = "moe_load"
MOE_EXPERT_LOAD = "moe_expert_load"

FAMILIES = (ACTV, ACTV_GRAD, ACTV_EVAL, GRAD_UNREDUCED, GRAD_REDUCED, PARAM_ORIGIN, PARAM_UPDATED,
            EXP_AVG, EXP_AVG_SQ, ADAM_UPDATE, ADAM_RATIO, MG_DIRECTION, COMM, SAVE, SAVE_GRAD,
            ATTENTION_HOOK, LINEAR_HOOK, MOE_ROUTER_WEIGHT_HOOK, MOE_ROUTER_LOGIT_HOOK, MOE_LOAD, MOE_EXPERT_LOAD)
ACTIVATION_FAMILIES = frozenset({ACTV, ACTV_GRAD, ACTV_EVAL})
SAVED_FAMILIES = frozenset({SAVE, SAVE_GRAD})
# Families whose records each hold one value (a feature of a module): named `<module>.<value's name>`.
FEATURE_FAMILIES = frozenset({ATTENTION_HOOK, LINEAR_HOOK, MOE_ROUTER_WEIGHT_HOOK, MOE_ROUTER_LOGIT_HOOK, MOE_LOAD,
                              MOE_EXPERT_LOAD})
# Those recorded at every training forward (the others once per step), as msprobe does.
PER_MICRO_FEATURE_FAMILIES = frozenset({ATTENTION_HOOK, MOE_ROUTER_LOGIT_HOOK})

# Phase of training in which a family's tensors are produced (used to name where a fault appeared).
PHASES = {
    ACTV: "forward",
    ACTV_GRAD: "backward",
    ACTV_EVAL: "evaluation",
    GRAD_UNREDUCED: "backward",
    GRAD_REDUCED: "optimizer",
    PARAM_ORIGIN: "optimizer",
    PARAM_UPDATED: "optimizer",
    EXP_AVG: "optimizer",
    EXP_AVG_SQ: "optimizer",
    ADAM_UPDATE: "optimizer",
    ADAM_RATIO: "optimizer",
    MG_DIRECTION: "optimizer",
    COMM: "communication",
    SAVE: "forward",
    SAVE_GRAD: "backward",
    ATTENTION_HOOK: "forward",
    LINEAR_HOOK: "forward",
    MOE_ROUTER_WEIGHT_HOOK: "forward",
    MOE_ROUTER_LOGIT_HOOK: "forward",
    MOE_LOAD: "forward",
    MOE_EXPERT_LOAD: "forward",
}


class RecordKey(NamedTuple):
    """Identifies one statistic record within a step of one rank.

    `micro_step` is None for records taken once per step. `call_index` orders every hooked event of
    the rank within the step, so "earliest" is a sort. A named tuple: hooks build one per recorded
    tensor, and a tuple is built in a third of a dataclass's time.
    """

    family: str
    name: str
    vpp_stage: int
    micro_step: Optional[int]
    call_index: int
    shape: tuple
    dtype: str

    @property
    def phase(self) -> str:
        return PHASES.get(self.family, "unknown")


_KEYS: dict = {}                # every key made by `record_key`, by the fields it was given
_KEYS_MAX = 1 << 17


def record_key(family: str, name: str, vpp_stage: int, micro_step: Optional[int], call_index: int, shape: tuple,
               dtype) -> RecordKey:
    """The RecordKey of these fields: the same object whenever they recur. `shape` may be a `torch.Size` (a tuple,
    equal to and hashed as the plain one the key keeps), and `dtype` a `torch.dtype` (the key keeps its name), which
    hooks pass as a tensor gives them: the name, made anew by each `str(dtype)`, is made only for a new key.

    Hooks make a key per recorded tensor, and the writer holds a step's keys long enough for Python's garbage
    collector to move them to its oldest generation, whose full collections then come every few dozen steps
    and take a pause proportional to the whole heap. A run's keys repeat from step to step, so one object
    per key is made once.
    """
    fields = (family, name, vpp_stage, micro_step, call_index, shape, dtype)
    key = _KEYS.get(fields)
    if key is None:
        if len(_KEYS) >= _KEYS_MAX:             # keys that do not repeat (shapes that change every step)
            _KEYS.clear()
        key = _KEYS[fields] = RecordKey(family, name, vpp_stage, micro_step, call_index, tuple(shape), str(dtype))
    return key


@dataclass(slots=True)
class StepBatch:
    """Everything one rank collected in one step.

    `values` (float64 [len(keys), N_FIELDS] mergeable records, see FIELDS) and the tensor-valued
    `scalars` become readable after `wait()`, which only the writer thread calls: on an accelerator the
    copy to the host may still be in flight when the batch is queued.
    """

    step: int
    rank: int
    pp_stage: int
    keys: list
    scalars: dict = field(default_factory=dict)
    values: Optional[np.ndarray] = None
    host: Optional[object] = None  # flat host tensor: records, then the tensor-valued scalars
    host_scalar_names: tuple = ()
    ready: Optional[object] = None  # event that completes the copy on an accelerator, or None
    # values -> per key {op: float | None}: set by the writer thread, run by the first sink that reads `derived`
    deriver: Optional[Callable[[np.ndarray], list]] = None
    _derived: Optional[list] = None
    # NaN sentinel: a (low, high) probe pair per key, read by `sentinel.verdict`.
    flag_keys: list = field(default_factory=list)
    flags: Optional[np.ndarray] = None
    # the columns of `values` the collector left to zero here (`schema.unasked_columns`)
    unasked: tuple = ()
    # An accelerator's slot table heads the host buffer: its first `table_rows` rows, of which `table_index` holds the
    # rows of the first len(table_index) keys (None: no table).
    table_index: Optional[np.ndarray] = None
    table_rows: int = 0
    # (source, target) rows of the table merged here, in order, before `table_index` picks the keys' rows
    table_merges: Optional[np.ndarray] = None

    @property
    def derived(self) -> list:
        """Per key, its figures {op: float | None}, derived once, when a sink first asks (a step written
        only to the database derives nothing)."""
        if self._derived is None:
            if self.deriver is None:
                raise RuntimeError(f"step {self.step}'s figures were read before a writer set its `deriver`")
            self._derived = self.deriver(self.values)
        return self._derived

    def wait(self) -> "StepBatch":
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None
        if self.host is not None:
            flat = self.host.numpy()
            start = self.table_rows * N_FIELDS
            from_table = 0 if self.table_index is None else len(self.table_index)
            n = start + (len(self.keys) - from_table) * N_FIELDS
            m = n + 2 * len(self.flag_keys)
            self.values = flat[start:n].reshape(-1, N_FIELDS)
            if from_table:
                table = flat[:start].reshape(-1, N_FIELDS)
                if self.table_merges is not None:
                    merge_rows(table, self.table_merges)
                self.values = np.concatenate([table[self.table_index], self.values])
            if self.unasked:
                self.values[:, list(self.unasked)] = 0.0
            self.flags = flat[n:m].reshape(len(self.flag_keys), 2)
            self.scalars.update(zip(self.host_scalar_names, (float(v) for v in flat[m:])))
            self.host = None
        if self.values is None:
            self.values = np.empty((0, N_FIELDS))
        if self.flags is None:
            self.flags = np.empty((0, 2))
        return self
