"""trainmon: numerical-health monitoring for large-model training."""
__version__ = "0.1.0"

from trainmon.monitor.config import ConfigError, load_config  # noqa: E402
from trainmon.monitor.saved import save, save_grad  # noqa: E402
from trainmon.monitor.trainer_mon import TrainerMon  # noqa: E402
from trainmon.read import Run, open_run  # noqa: E402

__all__ = ["TrainerMon", "save", "save_grad", "open_run", "Run", "ConfigError", "load_config", "__version__"]
