"""Every third-party loop runs twice: with its activations held for the collector's batch, and with every one read
in its hook (`stats_cpu.RecordsOnArrival`), which these small models' tensors are otherwise too small for."""
from __future__ import annotations

import pytest

from trainmon.monitor import stats_cpu, stats_native


@pytest.fixture(autouse=True, params=["held", "read in the hook"])
def activation_reads(request, monkeypatch):
    if request.param == "read in the hook":
        assert stats_native.prepare(wait=True)
        monkeypatch.setattr(stats_cpu.RecordsOnArrival, "MIN_ELEMENTS", 1)
    return request.param
