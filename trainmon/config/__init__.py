"""The monitor's configuration: the JSON config's keys and their checks (`keys`, `settings`), what changes while a
job runs (`dynamic`), which steps are collected (`schedule`), and where a run's output goes (`output`)."""
