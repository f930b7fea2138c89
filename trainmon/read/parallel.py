"""Reading ranks in parallel processes, with a progress bar on stderr."""
from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Sequence, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

# Below this many ranks, starting processes costs more than reading the ranks one after the other.
PARALLEL_FROM = 8


def map_ranks(function: Callable[[Item], Result], items: Sequence[Item], progress: bool = False,
              description: str = "reading ranks", workers: int | None = None) -> list[Result]:
    """`function` over `items` (one per rank), in order; in worker processes when there are many.

    Args:
        function: a module-level function (it is sent to the workers by name).
        items: what each call gets.
        progress: show a tqdm bar on stderr (when it is a terminal).
        description: the bar's label.
        workers: processes to use (default: one per CPU core).

    Raises:
        Whatever `function` raises, for the first item that fails.
    """
    workers = min(len(items), workers or os.cpu_count() or 1)
    bar = None
    if progress:
        from tqdm import tqdm
        # disable=None: no bar when stderr is not a terminal (a log file, a test)
        bar = tqdm(total=len(items), desc=description, unit="rank", file=sys.stderr, disable=None)
    try:
        if workers <= 1 or len(items) < PARALLEL_FROM:
            results = []
            for item in items:
                results.append(function(item))
                bar is not None and bar.update()
            return results
        # fork: the workers start at once with the reader already imported (no re-import of torch). Each worker
        # freezes what it inherited: its garbage collector must not destroy the parent's objects (a torch process
        # group's destructor waits for threads a forked child does not have).
        context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                              else None)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=gc.freeze) as pool:
            results = []
            for result in pool.map(function, items, chunksize=max(1, len(items) // (workers * 16))):
                results.append(result)
                bar is not None and bar.update()
            return results
    finally:
        if bar is not None:
            bar.close()
