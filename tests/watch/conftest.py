import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from runs import generate  # noqa: E402

STEPS, INF_STEP = 60, 40


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """3 ranks x 60 steps, an Inf entering rank 1's layers.3 at step 40 and reaching the others by all_reduce."""
    return generate(tmp_path_factory.mktemp("finished") / "run-a", ranks=3, steps=STEPS, inf_step=INF_STEP)


@pytest.fixture
def watch_log(caplog):
    """caplog of the daemon's logger; the logger as it was after the test (an in-process `trainmon watch` gives it a
    handler of the test's stderr and stops it from propagating)."""
    logger = logging.getLogger("trainmon.watch")
    before = logger.handlers[:], logger.propagate, logger.level
    logger.propagate = True
    yield caplog
    logger.handlers[:], logger.propagate = before[0], before[1]
    logger.setLevel(before[2])
