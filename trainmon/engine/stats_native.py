"""The assume-finite figures of many CPU tensors in one native call, each tensor read once where it lies.

stats_cpu's assume-finite path needs, per fp32/fp64 tensor, its sum, sum of squares, min, max and count of
|x| > lam. In torch ops that is a few op calls per tensor (about 2-6 µs of host work each), or a copy of the
tensors into shared buffers for one kernel call: for the hundreds of small activations of a small model's
step, the host work and the copy cost more than reading the data. Here a small C function, given the
tensors' addresses and lengths, reads each tensor in place in blocks of `BLOCK` elements (partials in the
data's type, added in float64: the precision of the one-pass kernel's rows). A block is summed in 128 bytes of
independent lanes while the lines 4 KB ahead, and the next tensor's first ones, are requested from memory: a step's
activations are read when the optimizer step begins, long after they were written, and there a loop that waits for
each line in turn took half as long again (`benchmarks/stats_kernels.py --cold`, benchmarks/README.md). A second
function reads one tensor and says whether its figures are its whole record (`one`): the collector reads a large
activation with it in its hook, while the data is still in the caches (`stats_cpu.RecordsOnArrival`). Where this
Python's headers are installed (Linux), the library is also built as an extension module, and Python calls that
function directly: through ctypes, whose conversion of its seven arguments costs about 1 µs, a call took as long as
reading an 8 K-element tensor. The batch function is called through ctypes (a few calls a step).

The first request builds it (one C compiler call, about 0.1 s) before it answers, or loads the library an earlier run
left on disk: every record of a run then comes from the same kernel, and two runs of one job agree to the last bit. It is built for this machine's CPU (`-march=native`) into inductor's cache directory,
under a name that changes with its source, the compiler flags and the CPU. A build or check that fails (no
C compiler) leaves the other kernels in place, with one message.

The figures are those of finite data: a NaN or an Inf makes the sum non-finite (the build lets the compiler
assume finite values, which vectorises min and max; a NaN still propagates through the sums), which sends the
tensor to the exact kernels, as on the rest of that path.
"""
from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch._C import _len_torch_dispatch_stack

from trainmon.engine.stat_kernels import FINITE_FIGURES, hardware
from trainmon.engine.stats_fused import PLAIN_TENSORS

logger = logging.getLogger("trainmon")

BLOCK = 4096                                        # elements per partial: the one-pass kernel's row
# A view is read in place where its runs are whole multiples of LANES elements (a head of q, k or v split from one
# projection: 64 or 128, 16 at hidden 64); others are copied by torch first (stats_cpu).
LANES = 16
_MODULE = "trainmon_figures"  # the library's name as a Python extension module
_SOURCE = r"""
#ifdef TRAINMON_PY
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#endif
#include <stdint.h>
#include <math.h>
#include <string.h>
#define BLOCK %(block)d
#define LANES %(lanes)d
/* out[5 * i ...]: sum, sum of squares, min, max and count of |x| > lam of tensor i (stat_kernels.FINITE_FIGURES): lens[i] elements from ptrs[i],
   in runs of runs[i] contiguous elements, each run steps[i] elements after the one before (a contiguous tensor is
   one run); partials of at most BLOCK elements in the data's type, added in double. */
#define PREFETCH 4096
/* whether v is finite, from its bits: the build lets the compiler take isfinite() as always true */
static int finite_bits(double v) { uint64_t b; memcpy(&b, &v, 8); return ((b >> 52) & 0x7ff) != 0x7ff; }
/* one element v into lane w of the figures (LANES_OPEN's; l: the threshold of the function that uses it) */
#define FIGURE(T, ABS, w, v) \
    s[w] += v; q[w] += v * v; mn[w] = v < mn[w] ? v : mn[w]; mx[w] = v > mx[w] ? v : mx[w]; \
    c[w] += ABS(v) > l ? (T)1 : (T)0;
/* W lanes of the five figures, empty; and their merge into r[0..4] */
#define LANES_OPEN(T, W) \
    T s[W], q[W], mn[W], mx[W], c[W]; \
    for (int w = 0; w < W; ++w) { s[w] = q[w] = c[w] = 0; mn[w] = INFINITY; mx[w] = -INFINITY; }
#define LANES_CLOSE(W, r) \
    for (int w = 1; w < W; ++w) { \
        s[0] += s[w]; q[0] += q[w]; c[0] += c[w]; \
        mn[0] = mn[w] < mn[0] ? mn[w] : mn[0]; mx[0] = mx[w] > mx[0] ? mx[w] : mx[0]; \
    } \
    r[0] = s[0]; r[1] = q[0]; r[2] = mn[0]; r[3] = mx[0]; r[4] = c[0];
#define FIGURES(NAME, T, ABS) \
/* 128 bytes of lanes: independent figures the compiler keeps in vector registers, and the lines PREFETCH bytes \
   ahead requested while these are summed (a read from memory otherwise waits for each line in turn). */ \
static void NAME##_block(const T* restrict y, int64_t e, T l, T* restrict r) { \
    enum { W = 128 / sizeof(T) }; \
    LANES_OPEN(T, W) \
    int64_t whole = e - e %% W; \
    for (int64_t j = 0; j < whole; j += W) { \
        __builtin_prefetch((const char*)(y + j) + PREFETCH); \
        __builtin_prefetch((const char*)(y + j) + PREFETCH + 64); \
        for (int w = 0; w < W; ++w) { T v = y[j + w]; FIGURE(T, ABS, w, v) } \
    } \
    for (int64_t j = whole; j < e; ++j) { T v = y[j]; FIGURE(T, ABS, 0, v) } \
    LANES_CLOSE(W, r) \
} \
/* `count` runs of `run` elements (a multiple of LANES), `step` apart: one partial in lanes, whose fixed width \
   keeps the figures in vector registers across runs. */ \
static void NAME##_runs(const T* restrict x, int64_t run, int64_t step, int64_t count, T l, T* restrict r) { \
    LANES_OPEN(T, LANES) \
    for (int64_t k = 0; k < count; ++k) { \
        const T* y = x + k * step; \
        for (int64_t j = 0; j < run; j += LANES) { \
            for (int w = 0; w < LANES; ++w) { \
                T v = y[j + w]; FIGURE(T, ABS, w, v) \
            } \
        } \
    } \
    LANES_CLOSE(LANES, r) \
} \
/* one tensor's figures into o[0..4] */ \
static void NAME##_tensor(const T* x, int64_t len, int64_t run, int64_t step, double lam, double* o) { \
    double s = 0, q = 0, c = 0, mn = INFINITY, mx = -INFINITY; \
    T r[5]; \
    /* a view's runs shorter than a block: as many whole runs to a partial as a block holds */ \
    int shorter = run < BLOCK && run < len; \
    int64_t per = shorter ? BLOCK / run : 1; \
    for (int64_t at = 0, from = 0; at < len; at += per * run, from += per * step) { \
        for (int64_t b = 0; b < run; b += BLOCK) { \
            if (shorter) \
                NAME##_runs(x + from, run, step, (len - at) / run < per ? (len - at) / run : per, (T)lam, r); \
            else \
                NAME##_block(x + from + b, run - b < BLOCK ? run - b : BLOCK, (T)lam, r); \
            s += r[0]; q += r[1]; c += r[4]; \
            mn = r[2] < mn ? r[2] : mn; mx = r[3] > mx ? r[3] : mx; \
        } \
    } \
    o[0] = s; o[1] = q; o[2] = mn; o[3] = mx; o[4] = c; \
} \
void NAME(int64_t n, const uint64_t* ptrs, const int64_t* lens, const int64_t* runs, const int64_t* steps, \
          double lam, double* out) { \
    for (int64_t i = 0; i < n; ++i) { \
        /* the next tensor lies elsewhere: its first lines are requested now */ \
        if (i + 1 < n) for (int p = 0; p < PREFETCH; p += 64) __builtin_prefetch((const char*)ptrs[i + 1] + p); \
        NAME##_tensor((const T*)ptrs[i], lens[i], runs[i], steps[i], lam, out + 5 * i); \
    } \
} \
/* NAME's figures of one tensor into o[0..4]; 1 where they are exact and its record needs nothing more: all four \
   finite (no NaN or Inf among the elements) and no element as far as `limit` from 0 (none saturated) */ \
int NAME##_one(const T* x, int64_t len, int64_t run, int64_t step, double lam, double limit, double* o) { \
    NAME##_tensor(x, len, run, step, lam, o); \
    return finite_bits(o[0]) && finite_bits(o[1]) && finite_bits(o[2]) && finite_bits(o[3]) && \
        o[2] > -limit && o[3] < limit; \
}
FIGURES(figures_float32, float, fabsf)
FIGURES(figures_float64, double, fabs)
#ifdef TRAINMON_PY
/* NAME_one for Python: its seven arguments taken as they come (ctypes converts each through an object of its own:
   about a microsecond a call, as long as reading an 8 K-element tensor) */
#define ONE_PY(NAME) \
static PyObject* NAME##_py(PyObject* self, PyObject* const* a, Py_ssize_t n) { \
    if (n != 7) { PyErr_SetString(PyExc_TypeError, #NAME " takes 7 arguments"); return NULL; } \
    uint64_t x = PyLong_AsUnsignedLongLong(a[0]), o = PyLong_AsUnsignedLongLong(a[6]); \
    int64_t len = PyLong_AsLongLong(a[1]), run = PyLong_AsLongLong(a[2]), step = PyLong_AsLongLong(a[3]); \
    double lam = PyFloat_AsDouble(a[4]), limit = PyFloat_AsDouble(a[5]); \
    if (PyErr_Occurred()) return NULL; \
    return PyLong_FromLong(NAME((const void*)(uintptr_t)x, len, run, step, lam, limit, \
                                (double*)(uintptr_t)o)); \
}
ONE_PY(figures_float32_one)
ONE_PY(figures_float64_one)
static PyMethodDef methods[] = {
    {"figures_float32_one", (PyCFunction)(void (*)(void))figures_float32_one_py, METH_FASTCALL, NULL},
    {"figures_float64_one", (PyCFunction)(void (*)(void))figures_float64_one_py, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "%(module)s", NULL, -1, methods};
PyMODINIT_FUNC PyInit_%(module)s(void) { return PyModule_Create(&module); }
#endif
""" % {"block": BLOCK, "lanes": LANES, "module": _MODULE}
_FLAGS = ["-O3", "-march=native", "-ffinite-math-only", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
          "-fno-trapping-math", "-shared", "-fPIC"]
DTYPES = (torch.float32, torch.float64)

enabled = True                                      # tests of the other kernels turn it off
_state = {"state": None}                            # None | "ready" | "failed"
_functions: dict = {}                               # dtype -> the loaded C function
_one_functions: dict = {}                           # dtype -> its function of one tensor (`one`)
_lock = threading.Lock()


def ready() -> bool:
    """Whether the library is loaded; the first call starts its build (or loads it from disk)."""
    state = _state["state"]
    if state == "ready":
        return enabled
    if state is None:
        with _lock:
            if _state["state"] is None:
                _start()
    return enabled and _state["state"] == "ready"


def callable_now() -> bool:
    """Whether the library may be called now: it is ready, and no compile traces and no dispatch mode watches the
    call (the library would bypass both)."""
    return ready() and not _len_torch_dispatch_stack() and not torch.compiler.is_compiling()


def usable(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the library may read `tensors` now: `callable_now`, and they are plain tensors (a subclass has its
    own dispatch)."""
    return callable_now() and set(map(type, tensors)).issubset(PLAIN_TENSORS)


def unavailable() -> bool:
    """Whether the other kernels serve for good: turned off, or the build or its check failed."""
    return not enabled or _state["state"] == "failed"


def prepare() -> bool:
    """Builds or loads the library (once). Whether it is ready."""
    return ready()


def figures(tensors: Sequence[torch.Tensor], lam: float) -> np.ndarray:
    """float64 `[len(tensors), 5]`: sum, sum of squares, min, max and count of |x| > lam of each tensor, all
    contiguous and of one dtype of DTYPES (`ready()` must have said so). Right where every element is finite."""
    if not tensors:
        return np.empty((0, len(FINITE_FIGURES)))
    # From lists: a generator costs a resumption per tensor.
    lengths = [t.numel() for t in tensors]
    return read(tensors[0].dtype, [t.data_ptr() for t in tensors], lengths, lam, lengths, lengths)


def one(dtype: torch.dtype):
    """The library's function of one plain tensor of `dtype`, where it may be called now, else None:
    `f(address, length, run, step, lam, limit, out)` writes the tensor's `figures` (5 float64) at the address `out`
    and returns 1 where they are its exact record: every element finite and none with |x| >= `limit`. Of
    `callable_now`'s conditions, compile is not asked: the tensors a compile traces are subclasses (fake, functional),
    never plain."""
    if _len_torch_dispatch_stack() or not (_state["state"] == "ready" and enabled or ready()):
        return None
    return _one_functions.get(dtype)


def read(dtype: torch.dtype, addresses: list[int], lengths: list[int], lam: float, runs: list[int],
         steps: list[int]) -> np.ndarray:
    """`figures` of the tensors of `dtype` whose data starts at `addresses`, `lengths` elements each, in runs of
    `runs` contiguous elements `steps` elements apart (`run_layout`; a contiguous tensor: its length both)."""
    out = np.empty((len(addresses), len(FINITE_FIGURES)))
    if addresses:
        # the four lists in one array, whose address is taken once (about 1 µs each time)
        n, layout = len(addresses), np.array([addresses, lengths, runs, steps], dtype=np.int64)
        at = layout.ctypes.data
        _functions[dtype](n, at, at + 8 * n, at + 16 * n, at + 24 * n, lam, out.ctypes.data)
    return out


def run_layout(t: torch.Tensor) -> Optional[tuple[int, int]]:
    """(run, step) of a non-empty view whose elements, taken in some order, lie in runs of `run` contiguous elements,
    each `step` elements after the one before, where runs are whole multiples of LANES elements (q, k and v split
    from one projection: a run per head and token), or in one run (a transpose or permutation of a contiguous
    tensor); None otherwise. The figures do not depend on the order of the elements, so the dims are taken from the
    largest stride to the smallest, broadcast dims (stride 0) first. Remembered by (shape, strides): a model's views
    repeat every micro-step."""
    where = (t.shape, t.stride())
    layout = _layouts.get(where, False)
    if layout is False:
        if len(_layouts) >= _LAYOUTS_MAX:          # shapes that do not repeat
            _layouts.clear()
        layout = _layouts[where] = _run_layout(*where)
    return layout


_layouts: dict = {}                                 # run_layout's answers by (shape, strides)
_LAYOUTS_MAX = 1 << 12


def _run_layout(shape: tuple, strides: tuple) -> Optional[tuple[int, int]]:
    dims = sorted([(stride, size) for size, stride in zip(shape, strides) if size != 1], reverse=True)
    if dims and dims[-1][0] == 0:
        broadcast = [dim for dim in dims if dim[0] == 0]
        dims = broadcast + dims[:-len(broadcast)]
    run, k = 1, len(dims) - 1
    while k >= 0 and dims[k][0] == run:
        run *= dims[k][1]
        k -= 1
    if k < 0:
        return run, run
    if run % LANES:
        return None
    step, span = dims[k][0], dims[k][0] * dims[k][1]
    for stride, size in reversed(dims[:k]):         # the outer dims must step as one
        if stride != span:
            return None
        span *= size
    return run, step


def _start() -> None:
    path = _library()
    if path is not None and path.exists():          # an earlier run's: every record of this run comes from it
        _finish(path)
        return
    _build(path)


def _build(path: Optional[Path]) -> None:
    try:
        if path is None:
            raise RuntimeError("no C compiler found (set CC to one)")
        path.parent.mkdir(parents=True, exist_ok=True)
        source = path.with_suffix(f".{os.getpid()}.c")
        partial = path.with_suffix(f".{os.getpid()}.partial.so")
        source.write_text(_SOURCE)
        try:
            attempts = [_flags()]
            if attempts[0] != _FLAGS:               # headers that do not build: without the extension module's part
                attempts.append(_FLAGS)
            for flags in attempts:
                done = subprocess.run([*_compiler(), *flags, "-o", str(partial), str(source)], capture_output=True,
                                      text=True, timeout=300)
                if done.returncode == 0:
                    break
            if done.returncode != 0:
                raise RuntimeError((done.stderr.strip().splitlines() or ["no message"])[-1])
            os.replace(partial, path)               # whole or absent, for every process that looks
        finally:
            source.unlink(missing_ok=True)
            partial.unlink(missing_ok=True)
        _finish(path)
    except Exception as exc:                        # no compiler, a read-only cache: the other kernels serve
        _refuse(exc)


def _finish(path: Path) -> None:
    """Loads the library and checks it on a sample; a damaged one is removed (the next run builds it again)."""
    try:
        library = ctypes.CDLL(str(path))
        module = None
        if hasattr(library, f"PyInit_{_MODULE}"):     # built with this Python's headers: `one` is called directly
            loader = importlib.machinery.ExtensionFileLoader(_MODULE, str(path))
            try:
                module = loader.create_module(importlib.machinery.ModuleSpec(_MODULE, loader, origin=str(path)))
            except ImportError:                     # not loadable as a module here: ctypes calls it
                module = None
        for dtype in DTYPES:
            function = getattr(library, f"figures_{str(dtype).split('.')[1]}")
            function.argtypes = [ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_double, ctypes.c_void_p]
            function.restype = None
            _functions[dtype] = function
            one = getattr(module or library, f"figures_{str(dtype).split('.')[1]}_one")
            if module is None:
                one.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_double, ctypes.c_double,
                                ctypes.c_void_p]
                one.restype = ctypes.c_int
            _one_functions[dtype] = one
            sample = torch.tensor([1.0, -2.0, 3.0, 0.0], dtype=dtype)
            got = figures([sample, sample[1:]], 0.5)
            if not np.array_equal(got, [[2.0, 14.0, -2.0, 3.0, 3.0], [1.0, 13.0, -2.0, 3.0, 2.0]]):
                raise RuntimeError(f"the {dtype} figures of a sample came out {got.tolist()}")
            alone = np.empty(5)
            clean = [one(sample.data_ptr(), 4, 4, 4, 0.5, limit, alone.ctypes.data) for limit in (4.0, 3.0)]
            if clean != [1, 0] or not np.array_equal(alone, got[0]):
                raise RuntimeError(f"the {dtype} figures of one sample came out {alone.tolist()}, {clean}")
        _state["state"] = "ready"
    except Exception as exc:
        path.unlink(missing_ok=True)
        _refuse(exc)


def _refuse(exc: BaseException) -> None:
    _state["state"] = "failed"
    if threading.main_thread().is_alive():          # else the interpreter is exiting: nothing to say
        logger.warning("trainmon: the native statistic kernel is not available (%s: %s); the other CPU kernels are "
                       "used", type(exc).__name__, exc)


def _flags() -> list[str]:
    """The compiler's flags; where this Python's headers are at hand on Linux (an extension module leaves Python's
    symbols to the process there), also those that make the library an extension module whose `one` Python calls
    without ctypes."""
    include = sysconfig.get_paths().get("include")
    if not sys.platform.startswith("linux") or not include or not os.path.exists(os.path.join(include, "Python.h")):
        return _FLAGS
    return [*_FLAGS, "-DTRAINMON_PY", f"-I{include}"]


def _compiler() -> Optional[list[str]]:
    """The C compiler's command: `$CC` (which may hold a wrapper, "ccache gcc"), else the first of cc, gcc, clang."""
    if os.environ.get("CC", "").strip():
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return [found] if found else None


def _library() -> Optional[Path]:
    """Where the library lives, or None without a C compiler."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # imports inductor: at the first request only

    compiler = _compiler()
    if compiler is None:
        return None
    recipe = "\n".join([_SOURCE, " ".join(_flags()), " ".join(compiler), platform.machine(), hardware("cpu"),
                        sysconfig.get_config_var("SOABI") or ""])
    return Path(cache_dir()) / "trainmon" / f"figures-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.so"
