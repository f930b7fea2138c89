"""Settings more than one floor reads, defined once: the writer queue's, the monitor daemon's, and the defaults
that both a config key and the code it configures state.

The config (`writer_*` keys, the `watch` section, `stats_batch_mb`, the spike rule's window, the dump's cap), the
writer thread, the collector, the anomaly rules, `trainmon watch`'s flags and the daemon spawned beside a job all
take their defaults from here."""
from __future__ import annotations

from dataclasses import dataclass

# What the writer thread does when its queue of step batches is full: wait, or drop the batch (counted).
WRITER_POLICIES: tuple[str, ...] = ("block", "drop")
WRITER_POLICY = "block"
WRITER_QUEUE_SIZE = 64  # step batches queued before the policy applies

STATS_BATCH_MB = 32     # activations held before one batched reduction
SPIKE_WINDOW = 50       # steps of history the spike rule's baseline spans
DUMP_MB_PER_STEP = 64   # tensor bytes a rank stores a step, for a dump or the sentinel's capture of a first NaN


@dataclass(frozen=True)
class WatchDefaults:
    """The monitor daemon's defaults."""

    interval: float = 5.0        # seconds between rounds
    stall_after: float = 300.0   # seconds without a committed step before a rank is reported stalled
    heatmap_every: int = 50      # steps between heatmap drawings while a run is live
    op: str = "norm"             # the op the module heatmaps show
    window: int = 200            # steps the heatmaps show
    source: str = "auto"         # the database when present, else the CSV files


WATCH = WatchDefaults()
