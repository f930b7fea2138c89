"""Anomalies while the job runs: the rules (`rules`), the writer thread's processor that applies them to each
step's records and writes anomalies.jsonl (`processor`), and the training thread's actions on an alert (`actions`:
stop, dump). What reads a finished run's anomalies afterwards is `trainmon.analysis`."""
