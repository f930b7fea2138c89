"""The ordering key: which of two records came first, on one rank or across ranks (design §3).

Within a (step, micro-step): forward before backward before the once-per-step families (communication,
then optimizer). In forward, pipeline stages ascend with virtual-pipeline chunks in schedule order:
chunk c of stage s is virtual stage c * pp_size + s, so `(vpp_stage, pp_stage)` ascending is that order
without knowing pp_size; in backward the same pair descends. Then the call index, a rank's own order of
its hooked events; the rank comes last. Ranks at the same stage place (step, micro-step, phase, stage)
are ties that only collectives' records can break (`cross_rank`): their call indices count each rank's
own events. Records taken once per step (micro_step None) follow the step's micro-steps, and records
without a call index (CSV rows) follow the indexed records of their stage place, in file order.

The first version sorted by rank before phase; on pipeline-parallel runs that named a rank's backward
before another rank's forward. `DESCRIPTION` goes into every rank's run.json.
"""
from __future__ import annotations

import math

VERSION = 2
PHASE_ORDER = ("forward", "backward", "communication", "optimizer")  # other phases (scalar) come after
_BACKWARD = PHASE_ORDER.index("backward")
_LAST = math.inf  # a missing micro-step or call index sorts after the present ones

DESCRIPTION = {
    "version": VERSION,
    "fields": ["step", "micro_step", "phase", "stage", "call_index", "rank"],
    "phases": list(PHASE_ORDER),
    "stage": "(vpp_stage, pp_stage) ascending in forward, descending in backward",
    "missing": "micro_step null (once per step) and call_index null (CSV rows) sort last",
    "ties": "ranks at the same step, micro_step, phase and stage; collectives' records decide",
}


def stage_place(event) -> tuple:
    """(step, micro-step, phase, stage position) of an event: ranks sharing it are ties."""
    phase = PHASE_ORDER.index(event.phase) if event.phase in PHASE_ORDER else len(PHASE_ORDER)
    sign = -1 if phase == _BACKWARD else 1
    return (event.step, _LAST if event.micro_step is None else event.micro_step, phase,
            sign * event.vpp_stage, sign * event.pp_stage)


def order_key(event) -> tuple:
    """The sort key of an event (anything with the AnomalyEvent fields); earliest first."""
    return stage_place(event) + (_LAST if event.call_index is None else event.call_index, event.rank)
