"""The commands on a real run written as a record stream (`"output_filesystem": "network"`): a corrupt frame costs
its own step only and is named with its file and offset, no command calls such a run clean or in agreement,
`stream2db` refuses a stream that is not whole, and no read command imports torch."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_anomaly_online import Clock, forward_inf
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.cli import main as cli_main
from trainmon.read.database import DbRankReader
from trainmon.read.stream_mirror import CACHE_ENV
from trainmon.writers import stream_format

STEPS, INF_STEP, MODULE = 6, 5, "layers.1.mlp.0"  # the last step: no later one inherits the Inf
CONFIG = {"targets": {}, "all_xy": True, "xy_distribution": True, "ops": ["norm", "nans", "infs"], "format": ["db"],
          "output_filesystem": "network", "strict": True}  # no alert rules: no anomalies.jsonl to fall back on
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished one-rank run, its stream only, with an Inf in MODULE's forward output at INF_STEP."""
    root = tmp_path_factory.mktemp("stream_run")
    config = root / "config.json"
    config.write_text(json.dumps(CONFIG))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MONITOR_OUTPUT_DIR", str(root / "out"))
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        forward_inf(model, Clock(model, 1), MODULE, INF_STEP, 0)
        monitor = TrainerMon(str(config))
        monitor.set_monitor(model, optimizer=optimizer)
        run_steps(model, optimizer, STEPS)
        monitor.stop()
    assert sorted(p.name for p in monitor.output_dir.iterdir()) == ["records.stream", "run.json"]
    return monitor.output_dir.parent


@pytest.fixture
def run(made, tmp_path, monkeypatch) -> Path:
    """A copy of the run, read with an empty cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return Path(shutil.copytree(made, tmp_path / "run"))


def stream_of(run: Path) -> Path:
    return run / "rank_0" / "records.stream"


def frame_of_step(stream: Path, step: int) -> tuple[int, int]:
    """(start, end) of the batch frame of `step`."""
    frames = stream_format.read_frames(stream)
    for start, end, payload in zip(frames.starts, frames.ends, frames.payloads):
        kind, content = stream_format.decode(payload)
        if kind == stream_format.BATCH and content.step == step:
            return start, end
    raise AssertionError(f"no frame of step {step}")


def corrupt(run: Path, step: int) -> str:
    """Flips a byte inside the frame of `step`; returns what a reader says of it: the file and the offset."""
    stream = stream_of(run)
    start, end = frame_of_step(stream, step)
    data = bytearray(stream.read_bytes())
    data[(start + end) // 2] ^= 0x20
    stream.write_bytes(bytes(data))
    return f"{stream}: {end - start} bytes at offset {start} are not a whole frame"


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def steps_read(capsys, run: Path) -> set[int]:
    code, out, _ = cli(capsys, "show", run, "--json")
    assert code == 0
    return {row["step"] for row in json.loads(out)}


def test_a_corrupt_frame_before_the_inf_costs_its_step_and_the_inf_is_still_named(run, capsys):
    said = corrupt(run, INF_STEP - 1)
    code, out, err = cli(capsys, "nan-analyze", run, "--json")
    report = json.loads(out)
    assert code == 1, err
    assert {k: report["first"][k] for k in ("step", "module", "phase", "tensor")} == \
        {"step": INF_STEP, "module": MODULE, "phase": "forward", "tensor": "output"}
    assert [w for w in report["warnings"] if said in w] and report["incomplete_ranks"] == [0]
    code, out, err = cli(capsys, "nan-analyze", run)
    assert code == 1 and "sources: rank 0: records.stream\n" in out and f"warning: {said}" in out
    code, out, err = cli(capsys, "show", run, "--max-rows", "1")
    assert code == 0 and f"trainmon show: warning: {said}" in err
    assert steps_read(capsys, run) == set(range(STEPS)) - {INF_STEP - 1}, "every other frame is read"


def test_a_corrupt_frame_holding_the_inf_leaves_no_command_saying_clean_or_agree(run, capsys):
    said = corrupt(run, INF_STEP)
    code, out, err = cli(capsys, "nan-analyze", run)
    assert code == 2 and "\nclean: " not in out and "not known to be clean" in out and said in out, out
    code, out, err = cli(capsys, "overflow", run)
    assert code == 2 and "not known to be clean" in out and said in err, (out, err)
    code, out, err = cli(capsys, "compare", run, run)
    assert code == 2 and "agree within tolerance" not in out and "cannot say whether the runs agree" in out, out
    assert err.count(said) == 1, err
    code, out, err = cli(capsys, "anomalies", run)
    assert code == 0 and said in err, "anomalies.jsonl, not the stream, holds anomalies: only a warning"
    code, out, err = cli(capsys, "watch", run, "--once", "--logdir", run.parent / "view")
    assert code == 2 and said in err, err
    assert steps_read(capsys, run) == set(range(STEPS)) - {INF_STEP}


def test_stream2db_refuses_a_corrupt_stream_and_with_force_writes_its_whole_frames(run, capsys):
    said = corrupt(run, 2)
    db = run / "rank_0" / "monitor.db"
    code, out, err = cli(capsys, "stream2db", run)
    assert code == 2 and not db.exists()
    assert err.count("\n") == 1 and said in err and "--force" in err, err
    code, out, err = cli(capsys, "stream2db", run, "--force")
    assert code == 0 and f"trainmon stream2db: warning: {said}" in err
    reader = DbRankReader(db)
    try:
        assert reader.steps() == set(range(STEPS)) - {2}
    finally:
        reader.close()


@pytest.mark.parametrize("damage", ["cut mid-frame", "no end frame", "junk after the end frame"])
def test_stream2db_refuses_a_stream_that_is_not_whole_and_show_says_why(run, capsys, damage):
    stream = stream_of(run)
    data = stream.read_bytes()
    frames = stream_format.read_frames(stream)
    last_batch = frames.starts[-2]
    cut = {"cut mid-frame": data[:last_batch + 100], "no end frame": data[:frames.starts[-1]],
           "junk after the end frame": data + b"junk"}[damage]
    stream.write_bytes(cut)
    said = {"cut mid-frame": f"{stream}: its last 100 bytes, from offset {last_batch}, are not a whole step batch",
            "no end frame": f"{stream}: no end frame after its last whole frame",
            "junk after the end frame": f"{stream}: 4 bytes after its end frame, at offset {len(data)}, are not a "
                                        "frame; ignored"}[damage]
    code, out, err = cli(capsys, "stream2db", run)
    assert code == 2 and said in err and not (run / "rank_0" / "monitor.db").exists(), err
    if damage != "no end frame":  # nothing is wrong with the frames there: the job may still be writing
        code, out, err = cli(capsys, "show", run, "--max-rows", "1")
        assert code == 0 and f"trainmon show: warning: {said}" in err, err
    code, out, err = cli(capsys, "stream2db", run, "--force")
    assert code == 0 and said in err


# A read command in a fresh interpreter, its mirror of the stream made on the way: torch must not be imported.
_WITHOUT_TORCH = """
import sys
from trainmon.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print("torch imported" if "torch" in sys.modules else "torch not imported", file=sys.stderr)
sys.exit(code)
"""


@pytest.mark.slow
@pytest.mark.parametrize("command", ["show", "nan-analyze", "overflow", "anomalies", "compare", "watch", "plot",
                                     "stream2db", "export"])
def test_every_read_command_on_a_stream_starts_without_torch(run, tmp_path, command):
    argv = {"show": ["show", run], "nan-analyze": ["nan-analyze", run], "overflow": ["overflow", run],
            "anomalies": ["anomalies", run], "compare": ["compare", run, run],
            "watch": ["watch", run, "--once", "--logdir", tmp_path / "view"],
            "plot": ["plot", run, "--family", "actv", "-o", tmp_path / "actv.png"], "stream2db": ["stream2db", run],
            "export": ["export", run, tmp_path / "parquet", "--quiet"]}[command]
    if command == "export":
        pytest.importorskip("pyarrow")
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, *map(str, argv)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), CACHE_ENV: str(tmp_path / "cache")})
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stderr  # 1: nan-analyze found the Inf
    assert done.stderr.splitlines()[-1] == "torch not imported", done.stderr
