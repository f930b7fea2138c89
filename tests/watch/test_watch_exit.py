"""How the daemon ends: a `kill -9` leaves none of its worker processes behind, and `--exit-on-anomaly` exits
as soon as the alert is written, without waiting for the heatmaps."""
import json
import signal
import time
from pathlib import Path

from runs import LiveRank, wait_for, watch

INTERVAL = 1.0


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue  # the thread ended meanwhile
    return found + [grandchild for child in found for grandchild in _children(child)]


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # killed, not yet reaped by its new parent


def test_kill_9_leaves_no_child_running(tmp_path):
    run = tmp_path / "run"
    ranks = [LiveRank(run, 0), LiveRank(run, 1)]
    daemon = watch(run, "--interval", 0.2, "--heatmap-every", 2)
    try:
        step = 0
        children = []
        while not children:  # the painter starts at the first redraw
            for rank in ranks:
                rank.write(step)
            step += 1
            time.sleep(0.2)
            children = _children(daemon.pid)
            assert daemon.poll() is None and step < 300, "no painter started"
        daemon.send_signal(signal.SIGKILL)
        daemon.communicate(timeout=30)
        wait_for(lambda: all(_gone(child) for child in children), timeout=5.0)
    finally:
        for rank in ranks:
            rank.close()


def test_exit_on_anomaly_exits_within_two_intervals_of_the_alert(tmp_path):
    run = tmp_path / "run"
    logdir = run / "watch"
    ranks = [LiveRank(run, 0), LiveRank(run, 1)]
    daemon = watch(run, "--interval", INTERVAL, "--exit-on-anomaly")
    try:
        for step in range(6):
            for rank in ranks:
                rank.write(step)
        wait_for(lambda: (logdir / "watch_state.json").exists() and
                 json.loads((logdir / "watch_state.json").read_text())["exported"] >= 4)
        ranks[0].write(6, nan=True)
        wait_for((logdir / "alerts.jsonl").exists, timeout=30)
        alerted = time.monotonic()
        _, err = daemon.communicate(timeout=60)
        took = time.monotonic() - alerted
    finally:
        for rank in ranks:
            rank.close()
    assert daemon.returncode == 3, err
    assert took < 2 * INTERVAL, f"exited {took:.1f} s after the alert"
    state = json.loads((logdir / "watch_state.json").read_text())
    assert state["alerts"]["current"]["step"] == 6, "the state keeps the alert"
