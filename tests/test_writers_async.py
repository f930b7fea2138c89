"""The writer thread: back-pressure, dropping, failing sinks, and what survives SIGTERM, SIGKILL and exit."""
import errno
import json
import logging
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import pytest
import torch

from writer_helpers import OPS, GatedSink, integrity, monitored
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon import trainer_mon
from trainmon.core.derive import derive_rows
from trainmon.core.records import StepBatch
from trainmon.writers.async_writer import AsyncWriter
from trainmon.writers.base import Sink

CHILD = os.path.join(os.path.dirname(__file__), "train_child.py")
SMALL = dict(targets={}, wg_distribution=True, ops=OPS, format=["db"])


def start_monitor(write_config, **config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**{**SMALL, **config}))
    monitor.set_monitor(model, optimizer=optimizer)
    gated = GatedSink()
    monitor._writer.sink.sinks.append(gated)
    return monitor, gated, lambda steps: run_steps(model, optimizer, steps)


def db_steps(rank_dir):
    with sqlite3.connect(f"file:{rank_dir / 'monitor.db'}?mode=ro", uri=True) as conn:
        return [s for (s,) in conn.execute("SELECT step FROM batches ORDER BY step")]


def test_a_slow_writer_does_not_stall_training_until_the_queue_fills(output_dir, write_config, caplog):
    monitor, gated, train = start_monitor(write_config, writer_queue_size=3)
    writer = monitor._writer
    train(1)
    assert gated.entered.wait(30)  # the worker holds step 0 and waits on the slow sink
    train(3)  # steps 1..3 fill the queue: the training thread never waited
    assert (writer.blocked_puts, writer.blocked_seconds, writer.queued_steps, gated.steps) == (0, 0.0, 4, [])
    step4 = threading.Thread(target=train, args=(1,))  # finds the queue full and waits for the writer
    step4.start()
    deadline = time.monotonic() + 60
    while not any("falls behind" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert step4.is_alive() and gated.steps == []  # still waiting: the writer has not moved
    gated.gate.set()
    step4.join(60)
    assert writer.blocked_puts == 1 and writer.blocked_seconds > 0
    monitor.stop()
    assert gated.steps == [0, 1, 2, 3, 4] and db_steps(monitor.output_dir) == [0, 1, 2, 3, 4]
    report = json.loads((monitor.output_dir / "run.json").read_text())["writer"]
    assert report["blocked_puts"] == 1 and report["blocked_seconds"] > 0 and report["written_steps"] == 5


def test_drop_policy_counts_every_dropped_step(output_dir, write_config, caplog):
    monitor, gated, train = start_monitor(write_config, writer_queue_size=2, writer_policy="drop")
    train(1)
    assert gated.entered.wait(30)
    train(6)  # steps 1, 2 are queued; 3..6 find the queue full
    assert monitor._writer.dropped_steps == 4 and monitor._writer.blocked_seconds == 0
    gated.gate.set()
    monitor.stop()
    report = json.loads((monitor.output_dir / "run.json").read_text())["writer"]
    assert (report["dropped_steps"], report["written_steps"], report["policy"]) == (4, 3, "drop")
    assert db_steps(monitor.output_dir) == [0, 1, 2]
    assert sum("queue (2 steps) is full" in r.getMessage() for r in caplog.records) == 1


class FullDiskSink(Sink):
    name = "full_disk"

    def write(self, batch):
        if batch.step >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_raising_sink_is_disabled_once_and_its_loss_counted(output_dir, write_config, caplog):
    def add_sink(monitor, step):
        if step == 0:
            monitor._writer.sink.sinks.append(FullDiskSink())

    monitor, _ = monitored(write_config, steps=5, grad_acc_steps=1, on_step=add_sink, format=["db"],
                           xy_distribution=False)
    report = json.loads((monitor.output_dir / "run.json").read_text())["writer"]
    assert report["disabled_sinks"] == {"full_disk": {"error": "write: OSError: [Errno 28] No space left on device",
                                                      "lost_steps": 3}}
    assert sum("full_disk sink failed" in r.getMessage() for r in caplog.records) == 1
    assert db_steps(monitor.output_dir) == [0, 1, 2, 3, 4]


def spawn(config, *args):
    return subprocess.Popen([sys.executable, CHILD, config, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def read_until(child, prefix, count=1):
    """Lines of the child's stdout up to the `count`-th line starting with `prefix`."""
    lines = []
    while sum(line.startswith(prefix) for line in lines) < count:
        line = child.stdout.readline()
        assert line, f"child ended early: {child.stderr.read()[-3000:]}"
        lines.append(line.strip())
    return lines


def full_config(write_config):
    return write_config(targets={}, xy_distribution=True, all_xy=True, wg_distribution=True, mv_distribution=True,
                        param_distribution=True, ops=OPS, format=["db", "csv", "tensorboard"])


@pytest.mark.slow
def test_sigterm_loses_no_step(output_dir, write_config):
    child = spawn(full_config(write_config))
    lines = read_until(child, "step ", 6)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == -signal.SIGTERM, err[-3000:]
    rank_dir = output_dir / lines[0].split()[1].split(os.sep)[-2] / "rank_0"
    finished = [int(line.split()[1]) for line in lines + out.splitlines() if line.startswith("step ")]
    steps = db_steps(rank_dir)
    # every step that finished is written; the step running at the signal may be written too
    assert steps[:len(finished)] == finished == list(range(len(finished))) and len(steps) <= len(finished) + 1
    assert integrity(rank_dir / "monitor.db") == "ok"
    assert json.loads((rank_dir / "run.json").read_text())["writer"]["written_steps"] == len(steps)


@pytest.mark.slow
def test_sigterm_reaches_the_jobs_own_handler_after_the_queue_is_written(output_dir, write_config):
    child = spawn(full_config(write_config), "--graceful")
    lines = read_until(child, "step ", 4)
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "graceful stop" in out and "done" in out, err[-3000:]
    rank_dir = output_dir / lines[0].split()[1].split(os.sep)[-2] / "rank_0"
    finished = [int(line.split()[1]) for line in lines + out.splitlines() if line.startswith("step ")]
    assert db_steps(rank_dir) == finished == list(range(len(finished)))


@pytest.mark.slow
def test_sigkill_leaves_every_committed_step(output_dir, write_config):
    child = spawn(full_config(write_config))
    rank_dir = output_dir / read_until(child, "output")[0].split()[1].split(os.sep)[-2] / "rank_0"
    committed, deadline = [], time.monotonic() + 120
    while len(committed) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
        if (rank_dir / "monitor.db").exists():
            try:
                committed = db_steps(rank_dir)
            except sqlite3.OperationalError:
                pass  # the schema is being created
    child.kill()
    child.communicate(timeout=60)
    assert len(committed) >= 4, "the child committed too few steps in time"
    assert integrity(rank_dir / "monitor.db") == "ok"
    steps = db_steps(rank_dir)
    assert steps[:len(committed)] == committed and steps == list(range(len(steps)))
    with sqlite3.connect(rank_dir / "monitor.db") as conn:
        per_step = dict(conn.execute("SELECT step, COUNT(*) FROM records GROUP BY step"))
        announced = dict(conn.execute("SELECT step, records FROM batches"))
    assert per_step == announced and len(set(per_step.values())) == 1  # complete steps only


@pytest.mark.slow
def test_interpreter_exit_without_stop_writes_everything(output_dir, write_config):
    child = spawn(full_config(write_config), "--steps", "5", "--no-stop")
    out, err = child.communicate(timeout=180)
    assert child.returncode == 0, err[-3000:]
    rank_dir = output_dir / out.split()[1].split(os.sep)[-2] / "rank_0"
    assert db_steps(rank_dir) == [0, 1, 2, 3, 4]
    assert json.loads((rank_dir / "run.json").read_text())["writer"]["written_steps"] == 5


def test_an_unwritable_output_directory_does_not_stop_training(tmp_path, monkeypatch, write_config, caplog):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("a file where the output directory should be")
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(blocker / "monitor_output"))
    monitor, losses = monitored(write_config, steps=2, grad_acc_steps=1, format=["csv", "db", "tensorboard"],
                                xy_distribution=False)
    assert len(losses) == 2 and monitor.generate_wgrad_metrics()  # training and the api went on
    report = monitor._writer.report()
    assert set(report["disabled_sinks"]) == {"csv", "db", "tensorboard"} and report["written_steps"] == 2
    assert all(info["lost_steps"] == 2 for info in report["disabled_sinks"].values())
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sum("cannot write to the output directory" in m for m in errors) == 1
    assert sum("sink failed in start" in m for m in errors) == 3
    # the summary points at what was written: the report logged with run.json's error, not run.json
    run_json = str(monitor.output_dir / "run.json")
    assert any(run_json in m and "'lost_steps': 2" in m for m in errors), errors
    incomplete = [r.getMessage() for r in caplog.records if "output is incomplete" in r.getMessage()]
    assert len(incomplete) == 1 and run_json not in incomplete[0], incomplete


def test_figures_are_derived_once_per_step_and_only_for_sinks_that_read_them(output_dir, write_config, monkeypatch):
    derived = []  # records per derived batch

    def counting_derive_rows(records, ops):
        derived.append(len(records))
        return derive_rows(records, ops)

    monkeypatch.setattr(trainer_mon, "derive_rows", counting_derive_rows)  # the deriver TrainerMon hands its writer
    for formats, steps_derived_by_sinks in ((["db"], 0), (["csv", "db"], 3)):
        derived.clear()
        monitor, gated, train = start_monitor(write_config, format=formats)
        gated.gate.set()
        train(3)
        monitor._writer.drain()
        assert len(derived) == steps_derived_by_sinks  # the database stores records, not figures
        wgrad = monitor.generate_wgrad_metrics()
        # The api derives the last step's batch when no sink did, and reuses the sinks' figures otherwise.
        assert len(derived) == max(steps_derived_by_sinks, 1) and len(set(derived)) == 1
        assert len(wgrad) == derived[0] and all(math.isfinite(figures["norm"]) for figures in wgrad.values())
        monitor.stop()


class WorkerKiller(Sink):
    """A sink whose first write raises what no handler of a batch catches, and ends the writer's worker."""

    name = "killer"

    def __init__(self):
        self.reached = threading.Event()

    def write(self, batch):
        self.reached.set()
        raise SystemExit("the worker is gone")


def test_a_producer_blocked_on_a_writer_whose_worker_died_goes_on(caplog):
    """The queue is full and the policy is to wait: the worker dies; the waiting put returns, later puts return at
    once, close() returns, and every step not written is counted as dropped."""
    sink = WorkerKiller()
    writer = AsyncWriter(sink, derive=lambda values: [], max_queue=1, policy="block")
    writer.start()
    done = threading.Event()

    def produce():
        for step in range(5):
            writer.put(StepBatch(step=step, rank=0, pp_stage=0, keys=[]))
        writer.close()
        done.set()

    with caplog.at_level(logging.ERROR, logger="trainmon"):
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        assert done.wait(30), "the producer hangs on a writer whose worker died"
    report = writer.report()
    assert sink.reached.is_set() and report["written_steps"] == 0
    assert report["dropped_steps"] + report["failed_steps"] == 5 - 1 and report["queued_steps"] >= 1
    assert caplog.text.count("the writer stopped") == 1
