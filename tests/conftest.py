import json
import os
from pathlib import Path

import pytest

# A custom op whose result aliases an input is an error in torch's own CI (`CI` set), a warning elsewhere: an error
# in every run of these tests, and in the jobs they launch.
os.environ["TORCHINDUCTOR_ERROR_ON_CUSTOM_OP_ALIASING"] = "1"
import torch  # noqa: E402

from process_group import interrupt_on_sigterm  # noqa: E402

torch.set_num_threads(1)
# Where there is no GPU, Triton's kernels run on the CPU under its interpreter: the accelerators' path is then tested
# here too. Set before anything imports Triton, which reads it when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def output_dir(tmp_path, monkeypatch):
    out = tmp_path / "monitor_output"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    monkeypatch.delenv("DYNAMIC_MONITOR", raising=False)
    return out


@pytest.fixture
def write_config(tmp_path):
    """Writes a config dict to a file and returns its path; `strict` on so hook bugs fail tests."""

    def write(name="config.json", **keys):
        keys.setdefault("strict", True)
        path = tmp_path / name
        path.write_text(json.dumps(keys))
        return str(path)

    return write


def pytest_configure(config):
    """A SIGTERM to pytest interrupts it as Ctrl-C does: the jobs the tests launched end with it
    (tests/process_group.py)."""
    interrupt_on_sigterm()


_SLOW = ("distributed", "loops")  # real multi-process jobs and third-party training loops


def pytest_collection_modifyitems(items):
    """Marks the tests of tests/distributed and tests/loops `slow` (`pytest -m "not slow"` is the fast set) and
    runs them after the fast ones, so that a plain `pytest` reports on everything else first."""
    for item in items:
        if Path(str(item.fspath)).parent.name in _SLOW:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: file order otherwise


@pytest.fixture
def browser(tmp_path):
    """A fresh headless Chromium at 1600 x 1000, the size the view is judged at (tests/cdp.py); the test is skipped,
    saying why, where none can run."""
    from cdp import Browser

    executable, why = Browser.find()
    if executable is None:
        pytest.skip(why)
    page = Browser(executable, tmp_path / "profile")
    page.viewport(1600, 1000)
    yield page
    page.close()
