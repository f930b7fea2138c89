"""Which steps are collected: start_step, step_interval, collect_times, module_ranks."""
from __future__ import annotations


class CollectionSchedule:
    """Decides, once per step, whether the step is collected.

    Steps are counted from `start_iteration` (a resumed job starts there). `collect_times` counts
    collected steps since the schedule was (re)started.
    """

    def __init__(self, start_step: int, step_interval: int, collect_times: int, rank_enabled: bool):
        self.start_step = start_step
        self.step_interval = step_interval
        self.collect_times = collect_times
        self.rank_enabled = rank_enabled
        self.collected = 0

    def wants(self, step: int) -> bool:
        return (self.rank_enabled
                and step >= self.start_step
                and (step - self.start_step) % self.step_interval == 0
                and self.collected < self.collect_times)

    def mark_collected(self) -> None:
        self.collected += 1
