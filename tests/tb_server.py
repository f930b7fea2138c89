"""`python -m tensorboard.main` on loopback for the browser tests, with trainmon's plugin found through the entry point
that setup.cfg declares: the installed one, or, where the installed trainmon does not declare it (an install older than
the checkout), the same written as a distribution's metadata on the path."""
from __future__ import annotations

import configparser
import contextlib
import importlib.metadata
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from cdp import free_port, wait_for_http

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def tensorboard_server(logdir: Path, site: Path) -> Iterator[str]:
    """Serves `logdir` until the block ends; gives its base URL. `site`: an empty directory for the entry point.

    Raises:
        RuntimeError: TensorBoard did not start (with the end of its stderr).
    """
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    entry_points = parser["options.entry_points"]["tensorboard_plugins"].strip()
    name, _, value = (part.strip() for part in entry_points.partition("="))
    installed = {(e.name, e.value) for e in importlib.metadata.entry_points(group="tensorboard_plugins")}
    if (name, value) not in installed:  # TensorBoard refuses a plugin name declared twice
        dist = site / "trainmon_structure_view-0.dist-info"
        dist.mkdir(parents=True, exist_ok=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: trainmon-structure-view\nVersion: 0\n")
        (dist / "entry_points.txt").write_text(f"[tensorboard_plugins]\n{entry_points}\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])}
    # a session of its own: the worker processes of its plugins end with it
    process = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                                "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_for_http(f"{base}/data/plugins_listing", 120)
        except OSError:
            process.kill()
            raise RuntimeError(f"tensorboard did not start: {process.communicate()[1][-3000:]}") from None
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
