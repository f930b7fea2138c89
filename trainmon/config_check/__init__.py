"""`trainmon config-check`: record what makes a job the job it is (environment, packages, hyperparameters,
initial weights, input data, random generators) and compare two such records."""
from trainmon.config_check.capture import ConfigCapture, capture

__all__ = ["ConfigCapture", "capture"]
