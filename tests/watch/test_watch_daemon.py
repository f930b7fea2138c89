"""The daemon as a daemon: resumes after kill -9 with the same events, reports a corrupt rank and a stalled
rank once each while the other ranks go on, flushes on SIGTERM, writes nothing into rank directories."""
import json
import math
import signal
import time

import pytest

from trainmon.core.layout import WRITER_REPORT
from runs import LiveRank, read_events, terminate, wait_for, watch, watch_once

from conftest import INF_STEP, STEPS


@pytest.mark.slow
def test_kill_9_and_restart_give_the_events_of_an_uninterrupted_daemon(finished_run, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    detail = ("--detail", "layers", "--ranks", 0, 1)  # more tags than the default view, written in the same rounds
    assert watch_once(finished_run, "--logdir", whole, "--heatmap-every", 1000, *detail).returncode == 0
    daemon = watch(finished_run, "--logdir", cut, "--interval", 0.2, "--heatmap-every", 1000, *detail)
    wait_for(lambda: (cut / "watch_state.json").exists() or daemon.poll() is not None)
    daemon.send_signal(signal.SIGKILL)  # mid-export: the state file may be behind the event file
    daemon.communicate(timeout=60)
    state = json.loads((cut / "watch_state.json").read_text())
    done = watch_once(finished_run, "--logdir", cut, "--heatmap-every", 1000, *detail)
    assert done.returncode == 0, done.stderr
    for run in ("max", "min", "median", "nonfinite_elements"):  # the sibling runs resume from the state file too
        assert len(list((cut / run).glob("events.out.tfevents.*"))) == 1, "the restart appends to the same file"
        (got, got_steps), (want, want_steps) = read_events(cut, run), read_events(whole, run)
        assert len(want) > (1000 if run == "max" else 10) and got.keys() == want.keys()
        for tag, values in want.items():
            assert [s for s, _ in got[tag]] == [s for s, _ in values], tag  # no duplicate, none missing
            assert all(a == b or (math.isnan(a) and math.isnan(b)) for (_, a), (_, b) in zip(got[tag], values)), tag
        assert got_steps == want_steps  # images, text and the layout too
    assert state["exported"] <= STEPS - 1


@pytest.mark.slow
def test_a_restart_with_nothing_left_to_export_draws_the_heatmaps_the_killed_daemon_did_not(finished_run, tmp_path):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert watch_once(finished_run, "--logdir", whole, "--heatmap-every", 1000).returncode == 0
    daemon = watch(finished_run, "--logdir", cut, "--interval", 0.2, "--heatmap-every", 1000)
    state = cut / "watch_state.json"
    wait_for(lambda: state.exists() and json.loads(state.read_text())["exported"] == STEPS - 1)
    daemon.send_signal(signal.SIGKILL)  # every step exported, the heatmaps of the last one not drawn yet
    daemon.communicate(timeout=60)
    assert watch_once(finished_run, "--logdir", cut, "--heatmap-every", 1000).returncode == 0
    drawn = {tag: steps for tag, steps in read_events(cut)[1].items() if tag.startswith("heatmaps/")}
    assert drawn and drawn == {tag: steps for tag, steps in read_events(whole)[1].items()
                               if tag.startswith("heatmaps/")}
    assert sorted(p.name for p in (cut / "heatmaps").glob("*.png")) == \
        sorted(p.name for p in (whole / "heatmaps").glob("*.png"))


def test_alert_matches_nan_analyze_with_the_collectives_path(finished_run, tmp_path):
    from trainmon.analysis.nan_analyze import analyze
    hook_out = tmp_path / "hook.json"
    done = watch_once(finished_run, "--logdir", tmp_path / "w", "--on-anomaly", f"cat > {hook_out}",
                      "--exit-on-anomaly")
    assert done.returncode == 3, done.stderr
    alert = json.loads((tmp_path / "w" / "alerts.jsonl").read_text().splitlines()[0])
    assert alert["first"] == analyze(finished_run)["first"]
    assert (alert["first"]["rank"], alert["first"]["step"], alert["first"]["module"]) == (1, INF_STEP, "layers.3")
    assert alert["collectives_path"] == ["rank 1 -> all_reduce[0-2]@dp#0 (step 40) -> rank 0,2"]
    assert json.loads(hook_out.read_text()) == alert, "--on-anomaly gets the alert on stdin"
    assert alert["message"] in done.stderr


@pytest.mark.slow
def test_corrupt_rank_gives_one_message_and_the_others_go_on(finished_run, tmp_path):
    import shutil
    run = tmp_path / "run-b"
    shutil.copytree(finished_run, run)
    (run / "rank_2" / "monitor.db").write_bytes(b"this is not a database" * 100)
    for metadata in run.glob("rank_*/run.json"):  # the ranks still running: no writer report in run.json
        running = {key: value for key, value in json.loads(metadata.read_text()).items() if key != WRITER_REPORT}
        metadata.write_text(json.dumps(running))
    daemon = watch(run, "--interval", 0.2, "--heatmap-every", 1000, "--ranks", 0, 2)
    # their last step counts as incomplete while the daemon follows them live
    wait_for(lambda: (run / "watch" / "watch_state.json").exists() and
             json.loads((run / "watch" / "watch_state.json").read_text())["exported"] == STEPS - 2)
    time.sleep(1.0)  # a few more rounds
    status, err = terminate(daemon)
    assert status == 0, err
    assert err.count("rank 2: cannot be read") == 1, err
    assert "monitor.db" in err
    events = read_events(run / "watch")[0]
    assert [s for s, _ in events["rank0/scalars/grad_norm"]] == list(range(STEPS - 1))
    assert not any(tag.startswith("rank2/") for tag in events)


@pytest.mark.slow
def test_stalled_rank_is_reported_once_and_sigterm_flushes(tmp_path):
    run = tmp_path / "run-c"
    ranks = [LiveRank(run, 0), LiveRank(run, 1)]
    state = run / "watch" / "watch_state.json"
    # the ranks start writing once the daemon runs: a stall counts from a rank's last commit, and the
    # daemon's start-up can take longer than --stall-after
    daemon = watch(run, "--interval", 0.2, "--stall-after", 1.5, "--heatmap-every", 10, "--ranks", 0, 1,
                   "--detail", r"layers\.1\.weight")
    try:
        wait_for(state.exists)
        for step in range(30):
            for rank in ranks:
                if rank.rank == 0 or step < 10:  # rank 1 stops writing after step 9
                    rank.write(step)
            time.sleep(0.15)
        wait_for(lambda: json.loads(state.read_text())["exported"] >= 28)
    finally:
        status, err = terminate(daemon)
        for rank in ranks:
            rank.close()
    assert status == 0, err
    assert err.count("rank 1: stalled") == 1, err
    events = read_events(run / "watch")[0]
    assert [s for s, _ in events["rank0/scalars/loss"]][-1] >= 28, "rank 0 goes on without the stalled rank"
    # the export stops waiting for a stalled rank and reads what it committed
    assert [s for s, _ in events["rank1/scalars/loss"]] == list(range(10))
    low = dict(events["detail/grad_reduced/layers.1.weight/norm_min"])
    high = dict(events["detail/grad_reduced/layers.1.weight/norm_max"])
    assert (low[3], high[3]) == (pytest.approx(math.sqrt(7.0)), pytest.approx(math.sqrt(11.0)))
    assert dict(events["detail/grad_reduced/layers.1.weight/norm_max_rank"])[3] == 1.0
    stalled = dict(events["Overview/stalled_ranks"])
    # rank 1's stall shows while rank 0 writes on; once rank 0 stops too, a late export may count it as well
    assert stalled[3] == 0 and 1 in stalled.values()
    # SIGTERM drew the heatmaps of the last step exported and saved the state
    state = json.loads(state.read_text())
    assert state["drawn_at"] == state["exported"]
    assert (run / "watch" / "heatmaps" / "actv_layer_x_step.png").exists()
    assert sorted(p.name for p in (run / "rank_0").iterdir()) == ["monitor.db", "run.json"], "the daemon adds nothing"


def test_bad_input_is_one_line_and_status_2(tmp_path):
    done = watch_once(tmp_path / "missing")
    assert done.returncode == 2 and "Traceback" not in done.stderr and str(tmp_path / "missing") in done.stderr
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "watch_state.json").write_text("{broken")
    (tmp_path / "run" / "rank_0").mkdir(parents=True)
    done = watch_once(tmp_path / "run", "--logdir", tmp_path / "w")
    assert done.returncode == 2 and "watch_state.json" in done.stderr and "Traceback" not in done.stderr
