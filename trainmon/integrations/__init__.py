"""Callbacks for training loops trainmon does not own: `integrations.transformers` (transformers' `Trainer`)
and `integrations.lightning` (Lightning's `Trainer`). Each imports its framework; the core never does."""
