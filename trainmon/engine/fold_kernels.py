"""The accelerators' record kernels in Triton: each reads its tensors once and folds their records into rows of a
slot table (`slot_table.SlotTable`), with no allocation, no host synchronisation and no merge launch of its own.

A launch's programs each reduce blocks of `BLOCK` elements into one partial record in registers (counts exact in
int32 per block, int64 across blocks; sums in the accumulation dtype per block, float64 across blocks; min and max
in the accumulation dtype, which holds every 16- and 32-bit value exactly), write it to a row of a workspace, and
count themselves done on an atomic counter. The last program of a tensor reads its tensor's partial rows in a fixed
order, reduces them and folds the result into the tensor's table row, then sets the counter back to 0 for the
next launch. A fixed order makes a tensor's record the same bits whichever program finishes last: two runs of one
job agree to the last bit, which float atomics across programs would not give.

The fold into the row is the schema's merge (counts and sums add, min of mins, max of maxes), so a row folded
twice in one step (a key recorded twice, a tensor read in pieces) holds the merge of the two records. The fold
uses atomics, so folds from two streams into one row stay whole.

`fold_one` reads one tensor of any strides (up to four dimensions after collapsing; an expanded tensor's
repeated elements count as often as they appear); `fold_many` reads many contiguous tensors of one dtype in one
launch (a family's parameters, grads or Adam moments), each into its own row. Both first read a device flag and
return at once where it is 0: a kernel inside a captured graph then costs next to nothing on steps that are not
collected.

Runs wherever Triton runs: CUDA and ROCm, XPU, Ascend NPUs with Triton-Ascend, and the CPU under
`TRITON_INTERPRET=1` (tests).
"""
from __future__ import annotations

import triton
import triton.language as tl

from trainmon.core import schema

# The row's columns by field, as the kernels read and write them.
_COUNT = tl.constexpr(schema.INDEX["count"])
_NANS = tl.constexpr(schema.INDEX["nans"])
_INFS = tl.constexpr(schema.INDEX["infs"])
_ZEROS = tl.constexpr(schema.INDEX["zeros"])
_SUM = tl.constexpr(schema.INDEX["sum"])
_SUMSQ = tl.constexpr(schema.INDEX["sumsq"])
_MIN = tl.constexpr(schema.INDEX["min"])
_MAX = tl.constexpr(schema.INDEX["max"])
_SAT = tl.constexpr(schema.INDEX["sat"])
_PINFS = tl.constexpr(schema.INDEX["pinfs"])
_WIDTH = tl.constexpr(schema.N_FIELDS)
BLOCK = 2048                                    # elements a program reads at a time
MAX_PROGRAMS = 1024                             # programs of one tensor in `fold_one`: enough to fill a GPU
MANY_PROGRAMS = 64                              # at most, per tensor of `fold_many`


@triton.jit
def _block(x, mask, lam, sat_lam, ACC: tl.constexpr):
    """The ten figures of one block of elements (masked-out ones count nowhere)."""
    v = x.to(ACC)
    a = tl.abs(v)
    finite = (a < float("inf")) & mask
    z = tl.where(finite, v, 0.0)
    count = tl.sum(finite.to(tl.int32), 0)
    nans = tl.sum(((v != v) & mask).to(tl.int32), 0)
    infs = tl.sum(((a == float("inf")) & mask).to(tl.int32), 0)
    pinfs = tl.sum(((v == float("inf")) & mask).to(tl.int32), 0)
    zeros = tl.sum((finite & (a <= lam)).to(tl.int32), 0)
    sat = tl.sum((finite & (a > sat_lam)).to(tl.int32), 0)
    total = tl.sum(z, 0)
    squares = tl.sum(z * z, 0)
    low = tl.min(tl.where(finite, v, float("inf")), 0)
    high = tl.max(tl.where(finite, v, -float("inf")), 0)
    return count, nans, infs, zeros, total, squares, low, high, sat, pinfs


@triton.jit
def _store_partial(work, row, count, nans, infs, zeros, total, squares, low, high, sat, pinfs):
    base = work + row * _WIDTH
    tl.store(base + _COUNT, count.to(tl.float64))
    tl.store(base + _NANS, nans.to(tl.float64))
    tl.store(base + _INFS, infs.to(tl.float64))
    tl.store(base + _ZEROS, zeros.to(tl.float64))
    tl.store(base + _SUM, total)
    tl.store(base + _SUMSQ, squares)
    tl.store(base + _MIN, low.to(tl.float64))
    tl.store(base + _MAX, high.to(tl.float64))
    tl.store(base + _SAT, sat.to(tl.float64))
    tl.store(base + _PINFS, pinfs.to(tl.float64))


@triton.jit
def _finish(work, first, programs, counter, table, slot, WIDEST: tl.constexpr):
    """Counts this program done; the tensor's last one reduces its `programs` partial rows from `first` on, in
    order, and folds them into the table's row `slot`."""
    tl.debug_barrier()                          # this program's partial row is written before it counts itself
    done = tl.atomic_add(counter, 1, sem="acq_rel")
    if done == programs - 1:
        index = tl.arange(0, WIDEST)
        present = index < programs
        rows = work + (first + index) * _WIDTH
        row = table + slot * _WIDTH
        for column in tl.static_range(_WIDTH):
            if column == _MIN:
                value = tl.min(tl.load(rows + column, mask=present, other=float("inf")), 0)
                tl.atomic_min(row + column, value)
            elif column == _MAX:
                value = tl.max(tl.load(rows + column, mask=present, other=-float("inf")), 0)
                tl.atomic_max(row + column, value)
            else:
                value = tl.sum(tl.load(rows + column, mask=present, other=0.0), 0)
                tl.atomic_add(row + column, value)
        tl.atomic_xchg(counter, 0)              # ready for the next launch


@triton.jit
def _reduce_blocks(x, n, first_block, block_step, s1, s2, s3, t0, t1, t2, t3, lam, sat_lam,
                   ACC: tl.constexpr, CONTIGUOUS: tl.constexpr, BLOCK_: tl.constexpr):
    """The figures of elements [first_block * BLOCK_ + k * block_step * BLOCK_ ...] of `x` (n elements; strides
    t0..t3 of sizes (., s1, s2, s3) where not CONTIGUOUS)."""
    count = tl.zeros([], tl.int64)
    nans = tl.zeros([], tl.int64)
    infs = tl.zeros([], tl.int64)
    zeros = tl.zeros([], tl.int64)
    sat = tl.zeros([], tl.int64)
    pinfs = tl.zeros([], tl.int64)
    total = tl.zeros([], tl.float64)
    squares = tl.zeros([], tl.float64)
    low = tl.full([], float("inf"), ACC)
    high = tl.full([], -float("inf"), ACC)
    lanes = tl.arange(0, BLOCK_).to(tl.int64)
    for start in range(first_block * BLOCK_, n, block_step * BLOCK_):
        offsets = start + lanes
        mask = offsets < n
        if CONTIGUOUS:
            where = offsets
        else:
            i3 = offsets % s3
            rest = offsets // s3
            i2 = rest % s2
            rest = rest // s2
            where = (rest // s1) * t0 + (rest % s1) * t1 + i2 * t2 + i3 * t3
        b_count, b_nans, b_infs, b_zeros, b_total, b_squares, b_low, b_high, b_sat, b_pinfs = _block(
            tl.load(x + where, mask=mask, other=0.0), mask, lam, sat_lam, ACC)
        count += b_count
        nans += b_nans
        infs += b_infs
        zeros += b_zeros
        total += b_total.to(tl.float64)
        squares += b_squares.to(tl.float64)
        low = tl.minimum(low, b_low)
        high = tl.maximum(high, b_high)
        sat += b_sat
        pinfs += b_pinfs
    return count, nans, infs, zeros, total, squares, low, high, sat, pinfs


@triton.jit
def fold_one_kernel(x, n, s1, s2, s3, t0, t1, t2, t3, table, slot, bounds, work, counter, flag,
                    ACC: tl.constexpr, CONTIGUOUS: tl.constexpr, BLOCK_: tl.constexpr, WIDEST: tl.constexpr):
    """One tensor into row `slot`; `bounds`: [zeros threshold, saturation threshold] in float64."""
    if tl.load(flag) == 0:
        return
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    lam = tl.load(bounds).to(ACC)
    sat_lam = tl.load(bounds + 1).to(ACC)
    count, nans, infs, zeros, total, squares, low, high, sat, pinfs = _reduce_blocks(
        x, n, program, programs, s1, s2, s3, t0, t1, t2, t3, lam, sat_lam, ACC, CONTIGUOUS, BLOCK_)
    _store_partial(work, program, count, nans, infs, zeros, total, squares, low, high, sat, pinfs)
    _finish(work, 0, programs, counter, table, slot, WIDEST)


@triton.jit
def fold_many_kernel(addresses, lengths, slots, firsts, spans, owners, table, bounds, work, counters, flag,
                     DTYPE: tl.constexpr, ACC: tl.constexpr, BLOCK_: tl.constexpr, WIDEST: tl.constexpr):
    """Contiguous tensors of one dtype, each into its row: program p reads blocks of tensor owners[p], whose
    programs are firsts[t] .. firsts[t] + spans[t] - 1."""
    if tl.load(flag) == 0:
        return
    program = tl.program_id(0)
    tensor = tl.load(owners + program)
    first = tl.load(firsts + tensor)
    span = tl.load(spans + tensor)
    x = tl.load(addresses + tensor).to(tl.pointer_type(DTYPE))
    lam = tl.load(bounds).to(ACC)
    sat_lam = tl.load(bounds + 1).to(ACC)
    count, nans, infs, zeros, total, squares, low, high, sat, pinfs = _reduce_blocks(
        x, tl.load(lengths + tensor), program - first, span, 1, 1, 1, 0, 0, 0, 0, lam, sat_lam, ACC, True, BLOCK_)
    _store_partial(work, program, count, nans, infs, zeros, total, squares, low, high, sat, pinfs)
    _finish(work, first, span, counters + tensor, table, tl.load(slots + tensor), WIDEST)


@triton.jit
def merge_row_kernel(table, source, target, flag):
    """Folds row `source` into row `target` (the same tensor recorded under a second key)."""
    if tl.load(flag) == 0:
        return
    for column in tl.static_range(_WIDTH):
        value = tl.load(table + source * _WIDTH + column)
        if column == _MIN:
            tl.atomic_min(table + target * _WIDTH + column, value)
        elif column == _MAX:
            tl.atomic_max(table + target * _WIDTH + column, value)
        else:
            tl.atomic_add(table + target * _WIDTH + column, value)
