"""A stall is measured from the commit of the rank's last step: a daemon started after the rank stopped
reports it at (that commit + --stall-after), within one interval, once."""
import signal
import threading
import time

import pytest

from runs import LiveRank, watch

INTERVAL, STALL_AFTER = 1.0, 8.0


@pytest.mark.slow
def test_stall_is_reported_once_at_the_last_commit_plus_stall_after(tmp_path):
    run = tmp_path / "run"
    rank = LiveRank(run, 0)
    for step in range(4):
        rank.write(step)
    committed = time.time()
    rank.close()
    time.sleep(1.0)  # the daemon starts when part of the stall has passed (its start-up takes 1-3 s)
    daemon = watch(run, "--interval", INTERVAL, "--stall-after", STALL_AFTER, "--heatmap-every", 1000)
    said: list = []  # (time, line) of every line on stderr
    reader = threading.Thread(target=lambda: said.extend((time.time(), line) for line in daemon.stderr))
    reader.start()
    try:
        deadline = committed + STALL_AFTER + 3 * INTERVAL + 2.0
        while time.time() < deadline and not any("stalled" in line for _, line in said):
            time.sleep(0.05)
        time.sleep(4 * INTERVAL)  # more rounds: the stall is said once
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=60)
        reader.join(timeout=10)
    following = next(at for at, line in said if "following" in line)
    assert following < committed + STALL_AFTER, "the daemon started too late for this test"
    stalls = [(at, line) for at, line in said if "stalled" in line]
    assert len(stalls) == 1, "".join(line for _, line in said)
    late = stalls[0][0] - (committed + STALL_AFTER)
    assert -0.2 < late < INTERVAL + 0.3, f"reported {late:+.2f} s from the last commit + --stall-after"
