"""The default thresholds of `trainmon compare` (here, apart from the comparisons, so that the command line
names them without importing torch)."""

DEFAULT_RTOL = 1e-3  # records: relative tolerance per op
DEFAULT_ATOL = 1e-6  # records: absolute tolerance
DEFAULT_COSINE = 0.99  # dumps: a tensor diverges below this cosine similarity (msprobe's) ...
DEFAULT_MAX_ABS = 0.001  # ... and above this max absolute error
