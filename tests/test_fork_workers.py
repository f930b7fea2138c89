"""The forked worker processes (the daemon's painter and readers, nan-analyze's rank readers) leave what they
inherited alone: garbage of the parent that its collector had not reached yet is never destroyed in a worker. A
destructor run there can hang it (a torch process group's waits for threads a forked child does not have); here
a destructor that writes down the process it ran in stands for one."""
import gc
import multiprocessing
import os
from pathlib import Path

import pytest

from trainmon.read.parallel import map_ranks
from trainmon.watch.workers import WorkerPool

pytestmark = [pytest.mark.slow,  # forks workers
              pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork here")]


class _Witness:
    """Part of a reference cycle: only the garbage collector destroys it."""

    def __init__(self, log: Path):
        self.log = log
        self.me = self

    def __del__(self):
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect(_item=None) -> int:
    gc.collect()
    return os.getpid()


@pytest.fixture
def uncollected_garbage(tmp_path):
    """A cycle that became garbage in this process and that its collector has not reached, as at a fork."""
    log = tmp_path / "destroyed_in"
    gc.disable()
    try:
        _Witness(log)
        yield log
    finally:
        gc.enable()
        gc.collect()


def test_the_daemons_workers_destroy_nothing_they_inherited(uncollected_garbage):
    pool = WorkerPool(1)
    try:
        worker = pool.submit(_collect).result(timeout=60)
    finally:
        pool.shutdown()
    assert worker != os.getpid()
    destroyed_in = uncollected_garbage.read_text().split() if uncollected_garbage.exists() else []
    assert str(worker) not in destroyed_in


def test_the_rank_readers_destroy_nothing_they_inherited(uncollected_garbage):
    workers = set(map_ranks(_collect, list(range(8)), workers=2))
    assert os.getpid() not in workers
    destroyed_in = set(uncollected_garbage.read_text().split()) if uncollected_garbage.exists() else set()
    assert not destroyed_in & {str(pid) for pid in workers}
