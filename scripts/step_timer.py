"""Per-step wall times of one rank, and the module calls of one step, for `benchmarks/frameworks.py`.

The example jobs take `--timings PATH`: each rank then writes `PATH.rank<R>.json` with the wall time of
every training step (from the end of one `optimizer.step()` to the end of the next, so everything the
step does counts, the monitor's own step work included), the process CPU time of the same intervals
(every thread: the monitor's writer too; less sensitive than wall time to other load) and that of the
training thread alone, the time the step spent in Python's garbage collector (its full collections are rare
pauses that medians hide) and, counted over one extra step after the timed ones, how many module forward calls
ran and how many of them received a grad in backward: the calls a monitor's module hooks see.
"""
from __future__ import annotations

import contextlib
import gc
import json
import time

import torch

from trainmon.engine import stat_kernels


class GcClock:
    """The time Python's garbage collector has run since the last `take()`."""

    def __init__(self):
        self._total, self._start = 0.0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self._total += time.perf_counter() - self._start

    def take(self) -> float:
        total, self._total = self._total, 0.0
        return total

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)


def _clocks() -> tuple[float, float, float]:
    """Wall time, the process's CPU time and the calling thread's."""
    return time.perf_counter(), time.process_time(), time.thread_time()


class StepTimer:
    """Collects this rank's step times; `count_calls()` wraps one untimed step that counts module calls."""

    def __init__(self, path: str, rank: int):
        self.path = f"{path}.rank{rank}.json"
        self.rank = rank
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.thread_times: list[float] = []
        self.gc_times: list[float] = []
        self.calls = {"forward": 0, "backward": 0}
        self._last = _clocks()
        self._gc = GcClock()

    def step_done(self) -> None:
        now = _clocks()
        self.times.append(now[0] - self._last[0])
        self.cpu_times.append(now[1] - self._last[1])
        self.thread_times.append(now[2] - self._last[2])
        self.gc_times.append(self._gc.take())
        if len(self.times) == 1:
            # The monitor's statistic kernels compile in the background during a run's first seconds: the
            # steps timed here are those of a longer run, with the kernels in place.
            stat_kernels.settle()
            now = _clocks()
        self._last = now

    @contextlib.contextmanager
    def count_calls(self, modules: list[torch.nn.Module]):
        """Counts, during the `with` block, forward calls of `modules` and the calls whose output got a grad."""
        def backward_seen(*_):
            self.calls["backward"] += 1

        def forward_hook(module, args, output):
            self.calls["forward"] += 1
            first = next((t for t in torch.utils._pytree.tree_leaves(output)
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
            if first is not None:
                first.register_hook(backward_seen)

        handles = [m.register_forward_hook(forward_hook) for m in modules]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"rank": self.rank, "step_s": self.times, "cpu_s": self.cpu_times, "thread_s": self.thread_times,
                       "gc_s": self.gc_times, "calls": self.calls}, f)
