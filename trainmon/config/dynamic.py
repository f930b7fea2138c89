"""Dynamic start/stop: with DYNAMIC_MONITOR=true the config file is re-read at step boundaries.

The user's file is never rewritten; what was applied is recorded in `dynamic_state.json` beside the
output instead.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Optional

from trainmon.config.settings import ConfigError, MonitorConfig, load_config

logger = logging.getLogger("trainmon")


def dynamic_enabled() -> bool:
    return os.environ.get("DYNAMIC_MONITOR", "").strip().lower() in ("1", "true", "yes", "on")


class DynamicConfigWatcher:
    def __init__(self, config_path: str, state_path: str):
        self.config_path = config_path
        self.state_path = state_path
        self._mtime = self._stat()

    def _stat(self) -> Optional[int]:
        try:
            return os.stat(self.config_path).st_mtime_ns
        except OSError:
            return None

    def poll(self, step: int) -> Optional[MonitorConfig]:
        """Returns the new config when the file changed since the last poll and is valid."""
        mtime = self._stat()
        if mtime is None or mtime == self._mtime:
            return None
        self._mtime = mtime
        try:
            config = load_config(self.config_path)
        except ConfigError as err:
            logger.error("trainmon: the changed config %s is invalid and was not applied: %s",
                         self.config_path, err)
            return None
        self._write_state(step, config)
        return config

    def _write_state(self, step: int, config: MonitorConfig) -> None:
        state = {"config_path": self.config_path, "applied_at_step": step, "dynamic_on": config.dynamic_on,
                 "config_mtime_ns": self._mtime, "applied_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        try:
            with open(self.state_path, "w") as f:
                json.dump(state, f, indent=1)
        except OSError as err:
            logger.warning("trainmon: could not record the dynamic state in %s: %s", self.state_path, err)
