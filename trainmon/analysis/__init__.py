"""Post-mortem analysis of a run's files, beside the job: where non-finite values first appeared and how they
crossed ranks (`nan_analyze`, `rank_summary`, `cross_rank`), loss-scale overflows (`overflow`), and msprobe's dump
directories read as the same events (`msprobe_dump`, `msprobe_comm`)."""
