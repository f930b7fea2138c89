"""The README's first command: `trainmon demo` trains and writes real output."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

from trainmon.demo import DEMO_CONFIG

ROOT = Path(__file__).resolve().parent.parent


def test_configs_demo_json_is_the_embedded_default():
    assert json.loads((ROOT / "configs" / "demo.json").read_text()) == DEMO_CONFIG


def test_trainmon_demo_runs_and_writes_every_family(tmp_path):
    env = {**os.environ, "MONITOR_OUTPUT_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "trainmon.cli", "demo", "--steps", "6"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "monitor output:" in out.stdout
    rank_dir = next(tmp_path.glob("*/rank_0"))
    for family in ["actv", "actv_grad", "grad_unreduced", "grad_reduced", "param_origin", "param_updated",
                   "exp_avg", "exp_avg_sq"]:
        frame = pd.read_csv(rank_dir / f"{family}_0-5.csv")
        assert sorted(set(frame.step)) == list(range(6)), family


def test_cli_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "trainmon.cli", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "demo" in out.stdout
