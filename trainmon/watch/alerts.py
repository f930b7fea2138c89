"""Live cross-rank attribution: one alert naming the earliest anomalous place across ranks, refined as
the other ranks report the same step.

Non-finite values are attributed by nan-analyze itself (`analysis.nan_analyze.analyze`: the ordering key,
the collectives' path), so an alert's `first` is what `trainmon nan-analyze --json` says on the same
output. Runs whose anomalies are all spikes or threshold crossings get the earliest anomaly in the
ordering key. Until every rank that is being followed has committed the alert's step, a later report
may name an earlier place (a rank that was behind): the alert is then refined, and the refinement is
written as such. The same place seen through another record (the sentinel's probe, another rule or op)
is the same incident, and gives no second alert. After that the alert is final; the ordering key starts
with the step, so no later step can change it.
"""
from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from trainmon.analysis.cross_rank import format_chain
from trainmon.analysis.nan_analyze import analyze, describe_place
from trainmon.core.ordering import order_key
from trainmon.watch.follow import RankFollower

logger = logging.getLogger("trainmon.watch")
ALERTS_FILE = "alerts.jsonl"
HOOK_TIMEOUT_S = 60


class AlertTracker:
    """Decides when to alert, writes alerts, runs the `--on-anomaly` command.

    Args:
        run: the run directory.
        logdir: where alerts.jsonl goes.
        emit_text: writes an alert's text to TensorBoard (step, markdown).
        on_anomaly: a shell command that gets each alert as JSON on stdin, or None.
        state: the tracker's part of an earlier daemon's state file.
    """

    def __init__(self, run: Path, logdir: Path, emit_text: Callable[[int, str], None],
                 on_anomaly: Optional[str] = None, state: Optional[dict] = None):
        self.run = run
        self.path = logdir / ALERTS_FILE
        self.emit_text = emit_text
        self.on_anomaly = on_anomaly
        state = state or {}
        self.current: Optional[dict] = state.get("current")
        self.final: bool = state.get("final", False)
        self.seen_step: Optional[int] = state.get("seen_step")  # earliest anomalous step seen on any rank

    def state(self) -> dict:
        return {"current": self.current, "final": self.final, "seen_step": self.seen_step}

    def note_step(self, step: int) -> None:
        """A step known to hold an anomaly (from the exported rows of a rank without a database)."""
        self.seen_step = step if self.seen_step is None else min(self.seen_step, step)

    def poll(self, followers: Sequence[RankFollower]) -> list[dict]:
        """Looks for anomalies on the readable ranks; returns the alerts written (first and refinements)."""
        if self.final:
            return []
        for follower in followers:
            if follower.error is None:
                try:
                    step = follower.nonfinite_after(-1)
                except Exception as err:  # the follower reports unreadable ranks on its own poll
                    logger.debug("trainmon watch: rank %s: %s", follower.rank, err)
                    continue
                if step is not None:
                    self.note_step(step)
        if self.seen_step is None:
            return []
        alert = self._attribute(followers)
        if alert is None:
            return []
        reported = [f.rank for f in followers if f.complete_through is not None and f.complete_through >= alert["step"]]
        waiting = [f.rank for f in followers if not f.stalled and f.rank not in reported]
        alert["ranks_reported"], alert["ranks_waiting"] = reported, waiting
        self.final = not waiting
        alert["final"] = self.final
        if self.current is not None and _same(self.current, alert):
            if self.final:
                self.current["final"] = True
            return []
        alert["alert"] = 1 if self.current is None else self.current["alert"] + 1
        alert["type"] = "first" if self.current is None else "refinement"
        if self.current is not None:
            alert["refines"] = self.current["alert"]
        self.current = alert
        self._write(alert)
        return [alert]

    def _attribute(self, followers: Sequence[RankFollower]) -> Optional[dict]:
        readable = [f.rank for f in followers if f.error is None]
        result = analyze(self.run, ranks=readable)
        base = {"run": str(self.run), "detected_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if result["first"] is not None:
            cross = result["cross_rank"]
            return base | {"anomaly": "nonfinite", "step": result["first"]["step"], "first": result["first"],
                           "first_record": result["first_record"], "ties": result["ties"],
                           "cross_rank": cross, "collectives_path": format_chain(cross) if cross else [],
                           "message": f"first NaN/Inf: {describe_place(result['first'])} "
                                      f"[{result['first_record']['op']}={result['first_record']['value']}, "
                                      f"{result['first_record']['rule']}]"}
        earliest = []
        for follower in followers:
            if follower.error is not None:
                continue
            reader = follower.open()
            try:
                events = reader.anomalies(enough=1) if hasattr(reader, "anomalies") else []
            finally:
                reader.close()
            earliest += events[:1]
        if not earliest:
            return None
        event = min(earliest, key=order_key)
        return base | {"anomaly": event.rule, "step": event.step, "first": event.where(),
                       "first_record": event.to_json(), "ties": [], "cross_rank": None, "collectives_path": [],
                       "message": f"first anomaly: {event.describe()}"}

    def _write(self, alert: dict) -> None:
        text = json.dumps(alert)
        label = "refines alert %d: " % alert["refines"] if alert["type"] == "refinement" else ""
        logger.warning("trainmon watch: alert %d (%s%s): %s%s", alert["alert"], label, alert["run"],
                       alert["message"], "" if alert["final"] else
                       f" (not final until rank(s) {', '.join(map(str, alert['ranks_waiting']))} finish step "
                       f"{alert['step']}: an earlier place may still come)")
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(text + "\n")
        lines = [f"**{'refinement of alert ' + str(alert['refines']) if label else 'alert'} {alert['alert']}**: "
                 f"{alert['message']}"]
        lines += [f"- {line}" for line in alert["collectives_path"]]
        self.emit_text(alert["step"], "\n".join(lines))
        if self.on_anomaly:
            self._run_hook(text)

    def _run_hook(self, text: str) -> None:
        try:
            done = subprocess.run(self.on_anomaly, shell=True, input=text, text=True, timeout=HOOK_TIMEOUT_S,
                                  capture_output=True)
        except (OSError, subprocess.TimeoutExpired) as err:
            logger.error("trainmon watch: --on-anomaly %r failed: %s", self.on_anomaly, err)
            return
        if done.returncode:
            logger.error("trainmon watch: --on-anomaly %r exited with %d: %s", self.on_anomaly, done.returncode,
                         done.stderr.strip()[-500:])


# What names an incident. The call index is not part of it: the sentinel's probe and the statistic of one tensor
# are separate records with call indexes of their own, and may arrive in different rounds.
_PLACE = ("rank", "step", "micro_step", "module", "phase", "tensor")


def _same(a: dict, b: dict) -> bool:
    """Whether two alerts name the same place (one incident, perhaps seen through another record or rule)."""
    return [a["first"].get(k) for k in _PLACE] == [b["first"].get(k) for k in _PLACE]
