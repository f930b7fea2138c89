"""The package version, written into run.json and the database (setup.cfg holds the same)."""

__version__ = "0.1.0"
