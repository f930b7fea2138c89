import json

import pytest
import torch

torch.set_num_threads(1)


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
