"""Every third-party loop runs twice: with its activations held for the collector's batch, and with every one read
in its hook (`stats_cpu.RecordsOnArrival`), which these small models' tensors are otherwise too small for."""
from __future__ import annotations

import pytest

from trainmon.engine import paths, stats_cpu, stats_native


@pytest.fixture(autouse=True, params=["held", "read in the hook"])
def activation_reads(request, monkeypatch):
    if request.param == "held":
        yield request.param
        return
    assert stats_native.prepare()
    monkeypatch.setattr(paths, "ON_ARRIVAL_MIN_ELEMENTS", 1)
    rows = []                                       # per call of `take`: its row, -1 where not taken
    take = stats_cpu.RecordsOnArrival.take

    def counted_take(self, t):
        rows.append(take(self, t))
        return rows[-1]
    monkeypatch.setattr(stats_cpu.RecordsOnArrival, "take", counted_take)
    yield request.param
    # Where the collector saw activations (not a sentinel-only config, not a compiled graph's tensors, read at once),
    # it read some in their hooks.
    assert not rows or max(rows) >= 0, f"none of {len(rows)} activations was read in its hook"
