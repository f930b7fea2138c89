"""The statistic engine: mergeable records of tensors, computed on their device without a host synchronisation.

`stats.tensor_records` reads any tensors (the CPU path in `stats_cpu` and `stats_native`, the generated one-pass
kernels in `stats_fused` and `stat_kernels`, the torch kernels everywhere); on an accelerator a step's records are
folded into a slot table (`slot_table`, `folding`, the Triton kernels of `fold_kernels`). `buffers` holds what they
share: chunks of any strides, reused workspaces, small host values copied to a device without blocking, and the merge
of records. `paths` says in one table which path reads which tensor, with the sizes that decide it; `records` gives
the records of tensors outside a step's collection through the kernels that serve their device.
"""
