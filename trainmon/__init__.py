"""trainmon: numerical-health monitoring for large-model training."""
from __future__ import annotations

import importlib

from trainmon.core.version import __version__

# Imported on first use, so that the command line and the read layer start without torch.
_LAZY = {"TrainerMon": "trainmon.trainer_mon", "open_run": "trainmon.read", "Run": "trainmon.read",
         "ConfigError": "trainmon.config.settings", "load_config": "trainmon.config.settings",
         "save": "trainmon.hooks.saved", "save_grad": "trainmon.hooks.saved",
         "register_sink": "trainmon.core.sinks"}

__all__ = ["TrainerMon", "save", "save_grad", "open_run", "Run", "ConfigError", "load_config", "register_sink",
           "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'trainmon' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
