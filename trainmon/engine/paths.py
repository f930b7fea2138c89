"""Which path reads which tensor, in one table, and the sizes that decide it (each measured; the benchmarks named).

| device | dtype | size | read | by |
| --- | --- | --- | --- | --- |
| an accelerator, or the CPU standing for one (`stats_fused.cpu_as_accelerator`) | any | any | in its hook | one fold into the step's slot table: a Triton kernel (`folding`), else the torch kernels |
| CPU | fp32, fp64 | `ON_ARRIVAL_MIN_ELEMENTS` or more | in its hook | the native read of one tensor (`stats_native`, `stats_cpu.RecordsOnArrival`) |
| CPU | fp32, fp64 | fewer | held for the step's next batch | the native read of many tensors in one call (`stats_cpu`); up to `SMALL` elements: segments of one buffer where the native read is missing |
| CPU | bf16, fp16 | any | held for the batch | the generated one-pass kernel (`stats_fused`; tensors below `GATHER_BELOW` copied into shared batches), else the multi-pass kernels |
| CPU | any | a name changed in place, up to `SNAPSHOT_MAX_BYTES` | copied in its hook | with the batch, as above |
| CPU | holding a NaN or an Inf | any | where the figures above came out non-finite | the exact kernels (`stats`) |

Weights, grads and optimizer state are read where the framework has just changed them (never held); on the CPU by
the batch's readers above, on an accelerator one fold launch per dtype for a family's tensors.
"""
from __future__ import annotations

# CPU activations from this size are read in their hooks, while their data is in the nearer caches: one native call
# costs no more than the tensor's share of a batch from here on, and it saves the hold (benchmarks/stats_kernels.py
# --arrival).
ON_ARRIVAL_MIN_ELEMENTS = 1 << 13
# A CPU tensor of a name that changes in place, up to this size, is copied and its copy read with the next batch: a
# copy costs less than a statistics call of its own (about 60-150 µs of host work, benchmarks/README.md).
SNAPSHOT_MAX_BYTES = 1 << 20
# Tensors up to this size (biases, norms, small weights) are reduced together as segments of one buffer where the
# native read is missing: for them the cost of an op call, not of the data, dominates.
SMALL = 1 << 12
# Where the native read is missing, from this size a tensor takes the assume-finite one-pass kernel: its calls (one
# for the whole rows, one for the rest) cost less than the passes they save. In calls of 20 tensors, per tensor,
# passes against kernel: 15.2 against 12.8 µs at 8 K elements, 35.9 against 22.2 at 64 K, but 13.8 against 18.4 at
# 4 K + 1; a call of one 8 K-element tensor, 48.2 against 44.6 µs (benchmarks/stats_kernels.py --one-pass-sizes).
ONE_PASS_MIN = 1 << 13
# Whole-row tensors up to this size are copied one after the other into shared calls of that kernel: per tensor,
# 7.0 against 11.0 µs at 8 K elements, 13.6 against 15.5 at 32 K, 22.9 against 22.0 at 64 K
# (benchmarks/stats_kernels.py --gather-sizes).
GATHER_MAX = 1 << 15
# The generated record kernel: tensors below this size are copied into shared batches, one kernel call per batch:
# the copy costs less than the host work of a call of their own (CPU bf16: 10.6 against 15.5 µs per tensor of 4 K
# elements, the same from 64 K on; benchmarks/stats_kernels.py --gather-sizes).
GATHER_BELOW = 1 << 17
# Elements read at a time by the torch kernels, per device type (measured), others DEFAULT_CHUNK_ELEMS: a chunk's
# passes after the first find it in the cache.
CHUNK_ELEMS = {"cpu": 1 << 19}
DEFAULT_CHUNK_ELEMS = 1 << 22
