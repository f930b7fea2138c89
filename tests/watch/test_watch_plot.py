"""`trainmon plot`: the daemon's pictures from a finished run."""
import os
import subprocess
import sys

from runs import ROOT


def plot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainmon.cli", "plot", *map(str, args)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_plot_writes_the_heatmap_and_rejects_what_is_not_there(finished_run, tmp_path):
    from PIL import Image
    out = tmp_path / "grads.png"
    done = plot(finished_run, "--family", "grad_reduced", "--op", "norm", "-o", out)
    assert done.returncode == 0, done.stderr
    with Image.open(out) as image:
        assert image.size == (1000, 600)
    done = plot(finished_run, "--family", "grad_norm", "-o", tmp_path / "norm.png")
    assert done.returncode == 0 and (tmp_path / "norm.png").exists(), done.stderr
    done = plot(finished_run, "--family", "nope", "-o", tmp_path / "x.png")
    assert done.returncode == 2 and "grad_reduced" in done.stderr and "Traceback" not in done.stderr
    done = plot(tmp_path / "missing", "--family", "actv", "-o", tmp_path / "x.png")
    assert done.returncode == 2 and "Traceback" not in done.stderr
