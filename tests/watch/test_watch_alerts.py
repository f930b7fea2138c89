"""Live alerts: one incident gives one alert, whichever of its records (the sentinel's, the statistic) the
daemon reads first."""
import json
import math
import time

from runs import KEYS, LiveRank, terminate, wait_for, watch
from trainmon.writers.anomaly_table import AnomalyTable
from trainmon.core.events import AnomalyEvent, phase_of, split_name


def _sentinel(rank: LiveRank, step: int) -> None:
    """The sentinel's record of the first tensor of `step`, written before the step's statistics are committed
    (the anomaly processor and the database are separate sinks), with the call index of its probe."""
    key = KEYS[0]
    module, tensor = split_name(key.family, key.name)
    table = AnomalyTable(rank.dir / "monitor.db")
    table.open()
    table.append([AnomalyEvent(rank.rank, step, key.micro_step, 0, 0, key.call_index + 7, module,
                               phase_of(key.family), tensor, "nonfinite", math.nan, "sentinel", key.family)])
    table.close()


def test_the_sentinel_and_the_statistic_in_different_rounds_give_one_alert(tmp_path):
    run = tmp_path / "run"
    logdir = run / "watch"
    alerts, calls = logdir / "alerts.jsonl", tmp_path / "hook.log"
    ranks = [LiveRank(run, 0), LiveRank(run, 1)]
    for step in range(3):
        for rank in ranks:
            rank.write(step)
    daemon = watch(run, "--interval", 0.2, "--on-anomaly", f"cat >> {calls} && echo >> {calls}")
    try:
        _sentinel(ranks[0], 3)
        wait_for(lambda: calls.exists() and calls.read_text().endswith("\n"))  # the sentinel's alert
        ranks[0].write(3, nan=True)  # then the statistic of the same tensor, at the record's call index
        time.sleep(1.0)  # rounds that read it while rank 1 has not reported step 3: the alert is not final
        ranks[1].write(3)
        ranks[0].write(4)
        ranks[1].write(4)
        wait_for(lambda: json.loads((logdir / "watch_state.json").read_text())["alerts"]["final"])
    finally:
        status, err = terminate(daemon)
        for rank in ranks:
            rank.close()
    assert status == 0, err
    assert len(alerts.read_text().splitlines()) == 1, alerts.read_text()
    assert len(calls.read_text().splitlines()) == 1, "--on-anomaly runs once"


def test_an_alert_waiting_for_the_rank_that_raised_it_says_what_it_waits_for(tmp_path, watch_log):
    from trainmon.read.layout import find_run
    from trainmon.watch.alerts import AlertTracker
    from trainmon.watch.follow import RankFollower
    run = tmp_path / "run"
    rank = LiveRank(run, 0)
    for step in range(3):
        rank.write(step)
    rank.write(3, nan=True)  # the newest step: more of it may still be committed
    follower = RankFollower(find_run(run).ranks[0])
    follower.poll(final=False)
    [alert] = AlertTracker(run, tmp_path, lambda step, text: None).poll([follower])
    rank.close()
    assert alert["step"] == 3 and alert["ranks_waiting"] == [0] and not alert["final"]
    [message] = [r.getMessage() for r in watch_log.records if "alert 1" in r.getMessage()]
    assert "have not reported" not in message and "not final until rank(s) 0 finish step 3" in message, message
