"""The daemon following ranks that write record streams (a network filesystem), live: every step of every rank
is exported once, a NaN step is seen, and nothing is written beside the streams."""
import json
import math
import time

import pytest

from runs import LiveRank, read_events, terminate, wait_for, watch


@pytest.mark.slow
def test_the_daemon_follows_record_streams_live(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINMON_CACHE_DIR", str(tmp_path / "cache"))
    run = tmp_path / "run-s"
    ranks = [LiveRank(run, 0, stream=True), LiveRank(run, 1, stream=True)]
    state = run / "watch" / "watch_state.json"
    daemon = watch(run, "--interval", 0.2, "--heatmap-every", 10, "--ranks", 0, 1)
    try:
        wait_for(state.exists)
        for step in range(20):
            for rank in ranks:
                rank.write(step, nan=(rank.rank == 1 and step == 12))
            time.sleep(0.1)
        for rank in ranks:
            rank.finish()
        wait_for(lambda: json.loads(state.read_text())["exported"] >= 19)
    finally:
        status, err = terminate(daemon)
    assert status == 0, err
    events = read_events(run / "watch")[0]
    for rank in (0, 1):
        loss = events[f"rank{rank}/scalars/loss"]
        assert [s for s, _ in loss] == list(range(20)), "each step once"
        assert [s for s, v in loss if math.isnan(v)] == ([12] if rank else [])
    for rank in (0, 1):
        assert sorted(p.name for p in (run / f"rank_{rank}").iterdir()) == ["records.stream", "run.json"]
    assert list((tmp_path / "cache").glob("*.stream-mirror.db")), "read through the local copy"
