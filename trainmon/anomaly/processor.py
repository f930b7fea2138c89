"""The online anomaly processor: a sink that judges every step batch in the writer thread.

Per rank and step it logs one line naming the earliest anomalous record by the ordering key
(`ordering`, the same key nan-analyze uses across ranks; a rule may add, at the step's end, records that
were anomalous only given the rest of the step, to trace it to its origin) and how many others there were, and
appends every anomaly to `rank_<R>/anomalies.jsonl` (one JSON object per line, flushed per step).
"""
from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
import time
from dataclasses import replace
from typing import Optional, Sequence

from trainmon.writers.anomaly_table import AnomalyTable
from trainmon.hooks.dump_capture import DumpRequest
from trainmon.writers.tensor_files import write_dump
from trainmon.core.events import (SCALAR_PHASE, SENTINEL_RULE, SENTINEL_VALUES, AnomalyEvent,
                                     phase_of, split_name)
from trainmon.anomaly.rules import Rule
from trainmon.hooks.sentinel import verdict
from trainmon.core.records import RecordKey, StepBatch
from trainmon.writers.base import Sink, SinkContext
from trainmon.core.layout import ANOMALIES_FILE, DB_NAME
from trainmon.writers.tags import tag_of

logger = logging.getLogger("trainmon")


class AlertRateLimit:
    """Lets the first `burst` alert lines through, then at most one every `interval` seconds."""

    def __init__(self, burst: int = 10, interval: float = 60.0, clock=time.monotonic):
        self.burst = burst
        self.interval = interval
        self.clock = clock
        self.suppressed = 0
        self._sent = 0
        self._last = -math.inf

    def allow(self) -> bool:
        now = self.clock()
        if self._sent < self.burst or now - self._last >= self.interval:
            self._sent += 1
            self._last = now
            return True
        self.suppressed += 1
        return False


class AnomalyProcessor(Sink):
    """Evaluates the rules and the NaN sentinel's probes on each step batch.

    Args:
        rules: the configured rules (see `rules.build_rules`).
        rate_limit: limits alert log lines; every anomaly is still written to the file.
        database: also append them to the `anomalies` table of `monitor.db` (with `format` "db").
    """

    name = "anomaly"

    def __init__(self, rules: Sequence[Rule], rate_limit: Optional[AlertRateLimit] = None, database: bool = False):
        self.rules = list(rules)
        self.rate_limit = rate_limit or AlertRateLimit()
        self.database = database
        self._table: Optional[AnomalyTable] = None
        self.anomaly_count = 0
        self._file = None
        self._rank = 0
        self._lock = threading.Lock()
        self._first_by_step: dict[int, AnomalyEvent] = {}
        self._listeners: list = []
        self._dumps: list[DumpRequest] = []
        self._rank_dir = None

    def start(self, context: SinkContext) -> None:
        self._rank = context.rank
        self._rank_dir = context.rank_dir
        context.rank_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(context.rank_dir / ANOMALIES_FILE, "a", encoding="utf-8")
        if self.database:
            self._table = AnomalyTable(context.rank_dir / DB_NAME)
            self._guard_table(self._table.open)

    def add_listener(self, callback) -> None:
        """`callback(events)` runs in the writer thread with each anomalous step's sorted events."""
        self._listeners.append(callback)

    def add_dump(self, request: DumpRequest) -> None:
        """Queues tensors captured on the training thread; written with their step's batch."""
        with self._lock:
            self._dumps.append(request)

    def first_of_step(self, step: int) -> Optional[AnomalyEvent]:
        """The earliest anomaly of `step` on this rank, once the step was written."""
        with self._lock:
            return self._first_by_step.get(step)

    # ----------------------------------------------------------------------------------- judge
    def write(self, batch: StepBatch) -> None:
        with self._lock:
            dumps, self._dumps = [d for d in self._dumps if d.step <= batch.step], \
                [d for d in self._dumps if d.step > batch.step]
        self._write_dumps(dumps)
        events = self._judge(batch)
        if not events:
            return
        events.sort(key=AnomalyEvent.order_key)
        events[0] = replace(events[0], first=True)
        with self._lock:
            self._first_by_step[batch.step] = events[0]
        self.anomaly_count += len(events)
        for event in events:
            self._file.write(json.dumps(event.to_json(), allow_nan=False) + "\n")
        self._file.flush()
        if self._table is not None:
            self._guard_table(self._table.append, events)
        self._alert(events)
        for callback in self._listeners:
            callback(events)

    def _judge(self, batch: StepBatch) -> list[AnomalyEvent]:
        events = []
        for key, (low, high) in zip(batch.flag_keys, batch.flags):
            found = verdict(key.family, low, high)
            if found is not None:
                events.append(self._event(batch, key, found, SENTINEL_VALUES[found], SENTINEL_RULE))
        if self.rules:
            records = [(tag_of(key, self._rank), key.family, ops) for key, ops in zip(batch.keys, batch.derived)]
            for rule in self.rules:
                rule.begin_step(records, batch.step, batch.keys)
            for key, row, (tag, _, ops) in zip(batch.keys, batch.values, records):
                for rule in self.rules:
                    events += [self._event(batch, key, op, float(v), rule.name)
                               for op, v in rule.check_record(tag, row, ops)]
            for name, value in batch.scalars.items():
                for rule in self.rules:
                    events += [self._scalar_event(batch, name, op, float(v), rule.name)
                               for op, v in rule.check_scalar(name, float(value))]
            events += self._traced(batch, records)
        return events

    def _traced(self, batch: StepBatch, records: list) -> list[AnomalyEvent]:
        """The events of what the rules found only because the step was anomalous (`Rule.end_step`)."""
        found = [(rule.name, traced) for rule in self.rules for traced in rule.end_step()]
        if not found:
            return []
        key_of = {tag: key for key, (tag, _, _) in zip(batch.keys, records)}
        return [self._event(batch, key_of[name], op, float(v), rule) if name in key_of
                else self._scalar_event(batch, name, op, float(v), rule) for rule, (name, op, v) in found]

    def _event(self, batch: StepBatch, key: RecordKey, op: str, value: float, rule: str) -> AnomalyEvent:
        module, tensor = split_name(key.family, key.name)
        return AnomalyEvent(rank=batch.rank, step=batch.step, micro_step=key.micro_step, pp_stage=batch.pp_stage,
                            vpp_stage=key.vpp_stage, call_index=key.call_index, module=module,
                            phase=phase_of(key.family), tensor=tensor, op=op, value=value, rule=rule,
                            family=key.family)

    @staticmethod
    def _scalar_event(batch: StepBatch, name: str, op: str, value: float, rule: str) -> AnomalyEvent:
        # A logged scalar has no place among the hooked events: it sorts after the step's tensors.
        return AnomalyEvent(rank=batch.rank, step=batch.step, micro_step=None, pp_stage=batch.pp_stage,
                            vpp_stage=0, call_index=None, module=name, phase=SCALAR_PHASE, tensor="scalar",
                            op=op, value=value, rule=rule, family="scalar")

    def _write_dumps(self, dumps: list[DumpRequest]) -> None:
        # A dump that cannot be written (disk full, safetensors missing) must not stop the anomaly records.
        for request in dumps:
            try:
                path = write_dump(self._rank_dir, request)
            except (OSError, ImportError) as err:
                logger.error("trainmon: the tensor dump of %s at step %s was not written: %s",
                             request.module or "<root>", request.step, err)
                continue
            logger.warning("trainmon: tensors of %s at step %s micro-step %s dumped to %s",
                           request.module or "<root>", request.step, request.micro_step, path)

    def _guard_table(self, method, *args) -> None:
        """A database failure stops only the table; anomalies.jsonl and the alerts go on."""
        try:
            method(*args)
        except sqlite3.Error as err:
            logger.error("trainmon: anomalies are no longer written to %s (%s); anomalies.jsonl still has them",
                         self._table.path, err)
            self._table.close()
            self._table = None

    def _alert(self, events: list[AnomalyEvent]) -> None:
        if not self.rate_limit.allow():
            return
        suppressed, self.rate_limit.suppressed = self.rate_limit.suppressed, 0
        note = f" ({suppressed} alert lines of later steps suppressed before this one)" if suppressed else ""
        logger.warning("trainmon: anomaly at %s; %d more anomalous record(s) this step%s",
                       events[0].describe(), len(events) - 1, note)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            dumps, self._dumps = self._dumps, []
        self._write_dumps(dumps)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._table is not None:
            self._table.close()
            self._table = None


def processor_for(config, database: bool = True) -> Optional[AnomalyProcessor]:
    """The processor a MonitorConfig asks for: with `alert.rules`, the sentinel, or a non-"warn" action.
    `database`: the `db` format writes monitor.db (not the record stream, whose readers take the anomalies
    from anomalies.jsonl), so the anomalies go into its table too."""
    from trainmon.anomaly.rules import build_rules

    if not (config.alert.rules or config.sentinel or config.alert.action != "warn"):
        return None
    return AnomalyProcessor(build_rules(config.alert.rules), database=database and "db" in config.format)
