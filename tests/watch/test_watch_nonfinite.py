"""Runs whose weights went NaN while the job kept going: every tensor of the last steps is all NaN, so ops
such as min have no value in whole chunks of steps. The daemon exports every step, live and with --once."""
import pytest

from runs import LiveRank, read_events, watch, watch_once

RANKS, STEPS, NAN_STEPS = 8, 220, 200


def _exported_steps(logdir):
    return [s for s, _ in read_events(logdir)[0]["Overview/loss"]]


@pytest.mark.slow
def test_all_nan_steps_are_exported_live_and_with_once(tmp_path):
    run = tmp_path / "run"
    ranks = [LiveRank(run, r) for r in range(RANKS)]
    daemon = watch(run, "--interval", 0.2, "--until-done", "--heatmap-every", 1000)
    try:
        for step in range(STEPS):
            for rank in ranks:
                rank.write(step, nan=step >= STEPS - NAN_STEPS)
    finally:
        for rank in ranks:
            rank.finish()
    _, err = daemon.communicate(timeout=120)
    assert daemon.returncode == 0, err
    assert _exported_steps(run / "watch") == list(range(STEPS))
    done = watch_once(run, "--logdir", tmp_path / "once", "--heatmap-every", 1000)
    assert done.returncode == 0, done.stderr
    assert _exported_steps(tmp_path / "once") == list(range(STEPS))
    nans = dict(read_events(tmp_path / "once")[0]["Overview/nan_elements"])
    assert nans[STEPS - NAN_STEPS - 1] == 0 and all(nans[s] > 0 for s in range(STEPS - NAN_STEPS, STEPS))
