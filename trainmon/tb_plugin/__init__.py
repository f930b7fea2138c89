"""The structure view: a TensorBoard plugin showing a run's module tree with per-node figures, the first
NaN/Inf and its path, and where the run parts from a baseline run (see `plugin` and `data`)."""
