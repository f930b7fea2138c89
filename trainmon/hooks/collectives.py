"""`cc_distribution`: statistics of the inputs and outputs of torch.distributed collectives and p2p ops.

The functions in `torch.distributed` (and `torch.distributed.distributed_c10d`, the same objects) are
replaced by wrappers while the monitor is installed; `remove()` puts the originals back. Outputs of a
synchronous call are recorded when it returns, those of an asynchronous one when its `Work.wait()`
returns (`Work.wait` is wrapped too). Inputs are recorded before the call with `cc_pre_hook` (a send's
tensor always: it has no output). See collective_ops for the record names.

Collectives called inside torch's `_coalescing_manager` are only queued there and run at its exit: their
outputs are recorded after the exit, or, with `async_ops`, when the exit's Work is waited for (Megatron's
`grad_reduce_handle` / `param_gather_handle`, DeepSpeed's coalesced all-gathers).

Functions bound before installation are seen where the binding is in collective_bindings' table: Megatron-
Core's `dist_reduce_scatter_func` / `dist_all_gather_func` (the distributed optimizer's grad reduce-scatter
and param all-gather) and its `_coalescing_manager`, DeepSpeed's comm backend's all-gather and reduce-scatter
functions (ZeRO). FSDP2 calls `torch.distributed.all_gather_single` / `reduce_scatter_single` (older torch:
`all_gather_into_tensor` / `reduce_scatter_tensor`) at call time, also through a custom `AllGather` /
`ReduceScatter` that calls them. Not seen: other bindings made before installation (`from torch.distributed
import all_reduce`), collectives issued from C++ or through `ProcessGroup` methods called directly (DDP's
built-in reducer without a Python communication hook, a custom FSDP2 collective that calls the process group
itself, DeepSpeed's shared-memory CPU all-reduce), outputs of async ops completed through
`Work.get_future()` instead of `wait()` (DDP communication hooks), and outputs of async ops waited for in a
later step than the one that issued them (their names' sequence numbers belong to that step).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import re
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks.collective_bindings import COALESCING_MANAGER, repoint, restore
from trainmon.core.collective_ops import (ALL_OPS, BATCH_P2P, COLLECTIVES, SENDS, collective_name,
                                             compact_ranks, p2p_name, tensor_names)
from trainmon.core.records import COMM, record_key
from trainmon.hooks.state import HookState

logger = logging.getLogger("trainmon")
_local = threading.local()


def floating(tensors) -> list[torch.Tensor]:
    return [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]

_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # trainmon's frames are not call sites


@contextlib.contextmanager
def not_monitored():
    """Collectives called inside (trainmon's own, or those a wrapped op makes internally) are not recorded."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def _suspended() -> bool:
    return getattr(_local, "depth", 0) > 0


class CollectiveMonitor(Hooks):
    """Installs the wrappers; one per TrainerMon.

    Args:
        state: the shared hook state (collecting flag, collector).
        pre_hook: also record inputs (`cc_pre_hook`).
        codelines: record only calls whose stack has a `file[line]` matching one of these regexes.
        log_only: only list the collectives used (op, group, dtypes, call sites) in `log_path` after the first
            collected step, then stop watching (`cc_log_only`).
        log_path: where the `log_only` list goes.
    """

    collects = "collectives (comm)"

    def __init__(self, state: HookState, pre_hook: bool, codelines, log_only: bool, log_path: Path):
        self.state = state
        self.pre_hook = pre_hook
        self.codelines = [re.compile(p) for p in codelines]
        self.log_only = log_only
        self.log_path = log_path
        self._wait = None
        self._rebound: list = []  # collective_bindings.Rebound: what remove() puts back
        self._installed = False
        self._step = None
        self._seq: dict = {}
        self._pending: dict = {}  # id(Work) → (Work, step issued, [(name, tensor)])
        self._coalescing: dict = {}  # group → [(name, tensor)]: outputs of calls queued in a coalescing manager
        self._untracked_warned = False
        self._ranks: dict = {}
        self._log: dict = {}

    # ------------------------------------------------------------------------- install/remove
    def install(self) -> None:
        wrappers = {}
        for op in ALL_OPS:
            original = getattr(dist, op, None)
            if original is not None:  # ops of newer torch versions
                wrappers[op] = (original, self._wrap_batch(original) if op == BATCH_P2P else self._wrap(op, original))
        coalescing = getattr(c10d, COALESCING_MANAGER, None)
        if coalescing is not None:
            wrappers[COALESCING_MANAGER] = (coalescing, self._wrap_coalescing(coalescing))
        self._rebound = repoint(wrappers)
        self._wait = c10d.Work.wait
        monitor, original_wait = self, self._wait

        @functools.wraps(original_wait)
        def wait(work, *args, **kwargs):
            done = original_wait(work, *args, **kwargs)
            if monitor._pending:
                monitor._completed(work)
            return done

        c10d.Work.wait = wait
        self._installed = True

    def remove(self) -> None:
        if not self._installed:
            return
        restore(self._rebound)
        self._rebound = []
        c10d.Work.wait = self._wait
        self._pending.clear()
        self._coalescing.clear()
        self._installed = False

    def step_finished(self, collected: bool) -> None:
        if self.log_only and collected and self._installed:
            self.log_path.write_text(json.dumps(self._log, indent=1, sort_keys=True))
            logger.info("trainmon: cc_log_only: collectives listed in %s; collectives are no longer watched",
                        self.log_path)
            self.remove()

    # ----------------------------------------------------------------------------- wrappers
    def _wrap(self, op: str, original):
        signature = inspect.signature(original)
        record = self.state.guarded(f"collective {op}", self._before)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if _suspended() or not self._installed or not self.state.collecting:
                return original(*args, **kwargs)
            outputs = record(op, signature, args, kwargs)
            with not_monitored():  # what the op calls internally is part of this call
                result = original(*args, **kwargs)
            if outputs:
                self._outputs_ready(result, outputs)
            return result

        return wrapper

    def _wrap_batch(self, original):
        record = self.state.guarded(f"collective {BATCH_P2P}", self._before_batch)

        @functools.wraps(original)
        def batch_isend_irecv(p2p_op_list):
            if _suspended() or not self._installed or not self.state.collecting:
                return original(p2p_op_list)
            outputs = record(p2p_op_list)
            with not_monitored():
                works = original(p2p_op_list)
            if outputs:
                # One work per op on backends without coalescing; else the last work completes them all.
                if works and len(works) == len(p2p_op_list):
                    for work, out in zip(works, outputs):
                        if out:
                            self._await(work, out)
                elif works:
                    self._await(works[-1], [o for out in outputs for o in out])
            return works

        return batch_isend_irecv

    def _wrap_coalescing(self, original):
        """torch's `_coalescing_manager` queues the collectives called inside it and issues them at its exit:
        their outputs are ready after the exit (synchronous) or when the exit's Work is waited for."""
        signature = inspect.signature(original)

        @functools.wraps(original)
        @contextlib.contextmanager
        def coalescing_manager(*args, **kwargs):
            if _suspended() or not self._installed or not self.state.collecting:
                with original(*args, **kwargs) as manager:
                    yield manager
                return
            bound = signature.bind(*args, **kwargs)
            group = _resolved(bound.arguments.get("group"))
            queued = self._coalescing[group] = []
            try:
                with original(*args, **kwargs) as manager:
                    yield manager
            finally:
                self._coalescing.pop(group, None)
            if queued:
                works = getattr(manager, "works", None)
                if works:  # async_ops: the exit's one Work completes every queued call
                    self._await(works[-1], queued)
                else:
                    self.state.guarded("collective outputs", self._record)(queued)

        return coalescing_manager

    def _outputs_ready(self, result, outputs) -> None:
        if isinstance(result, c10d.Work):
            self._await(result, outputs)
        else:
            self.state.guarded("collective outputs", self._record)(outputs)

    def _await(self, work, outputs) -> None:
        self._pending[id(work)] = (work, self.state.collector.step, outputs)

    def _completed(self, work) -> None:
        """Records the outputs of an async call when its Work is waited for within the step that issued it (its
        name's sequence number belongs to that step; one waited for later is not recorded)."""
        entry = self._pending.pop(id(work), None)
        if entry is not None and entry[0] is work and entry[1] == self.state.collector.step and self.state.collecting:
            self.state.guarded("collective outputs", self._record)(entry[2])

    # ----------------------------------------------------------------------------- records
    def _new_step(self) -> None:
        if self._step != self.state.collector.step:
            self._step = self.state.collector.step
            self._seq.clear()
            self._pending.clear()

    def _next_seq(self, key) -> int:
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return seq

    def _group(self, group) -> tuple[str, str]:
        """(compact ranks, torch's group name) of `group`."""
        described = self._ranks.get(group)
        if described is None:
            described = self._ranks[group] = (compact_ranks(dist.get_process_group_ranks(group)),
                                              c10d._get_process_group_name(group))
        return described

    def _before(self, op: str, signature, args, kwargs):
        """Names the call, records its inputs when wanted; returns the (name, tensor) outputs to record."""
        self._new_step()
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        group = _resolved(a.get("group"))
        if op in COLLECTIVES:
            base = collective_name(op, *self._group(group), self._next_seq(("group", id(group))))
            inputs, outputs = COLLECTIVES[op].inputs(a), COLLECTIVES[op].outputs(a)
            if group in c10d._world.pg_coalesce_state:  # queued: runs at the coalescing manager's exit
                outputs = self._named(op, base, inputs, outputs, always_inputs=False)
                self._defer_coalesced(group, outputs)
                return []
        else:
            me, peer = dist.get_rank(), _peer(a, group, "dst" if op in SENDS else "src")
            src, dst = (me, peer) if op in SENDS else (peer, me)
            base = p2p_name(op, src, dst, self._group(group)[1], self._next_seq(("p2p", id(group), src, dst)))
            inputs, outputs = ([a["tensor"]], []) if op in SENDS else ([], [a["tensor"]])
        return self._named(op, base, inputs, outputs, always_inputs=op in SENDS)

    def _defer_coalesced(self, group, outputs) -> None:
        queued = self._coalescing.get(group)
        if queued is not None:
            queued.extend(outputs)
        elif outputs and not self._untracked_warned:
            self._untracked_warned = True
            logger.warning("trainmon: cc_distribution: collectives queued in a coalescing manager that trainmon does "
                           "not know (bound before set_monitor): their outputs are not recorded, their inputs are")

    def _before_batch(self, p2p_op_list):
        self._new_step()
        me, per_op = dist.get_rank(), []
        for p2p in p2p_op_list:
            sends = getattr(p2p.op, "__name__", "") in SENDS
            src, dst = (me, p2p.peer) if sends else (p2p.peer, me)
            op = "isend" if sends else "irecv"
            group = _resolved(p2p.group)
            base = p2p_name(op, src, dst, self._group(group)[1], self._next_seq(("p2p", id(group), src, dst)))
            per_op.append(self._named(op, base, [p2p.tensor] if sends else [], [] if sends else [p2p.tensor],
                                      always_inputs=sends) or [])
        return per_op

    def _named(self, op, base, inputs, outputs, always_inputs: bool):
        inputs, outputs = floating(inputs), floating(outputs)
        if self.codelines or self.log_only:
            sites = [f"{f.filename}[{f.lineno}]" for f in traceback.extract_stack()
                     if not f.filename.startswith(_OWN)]
            if self.codelines and not any(p.search(s) for p in self.codelines for s in sites):
                return []
            if self.log_only:
                self._log_use(op, base, inputs or outputs, sites)
                return []
        if inputs and (self.pre_hook or always_inputs):
            self._record(list(zip(tensor_names(base, "input", len(inputs)), inputs)))
        return list(zip(tensor_names(base, "output", len(outputs)), outputs))

    def _log_use(self, op: str, base: str, tensors, sites) -> None:
        entry = self._log.setdefault(op, {"groups": [], "dtypes": [], "call_sites": []})
        for field, value in (("groups", base[base.index("[") + 1:base.index("]")]),
                             ("dtypes", str(tensors[0].dtype) if tensors else "none"),
                             ("call_sites", sites[-1] if sites else "unknown")):
            if value not in entry[field]:
                entry[field].append(value)

    def _record(self, named) -> None:
        if not named:
            return
        collector = self.state.collector
        keys = [record_key(COMM, name, 0, None, collector.next_call_index(), tuple(t.shape), t.dtype)
                for name, t in named]
        collector.record(keys, [t.detach() for _, t in named])


def _peer(arguments: dict, group, key: str) -> int:
    """The peer's global rank from `dst`/`src`, or from `group_dst`/`group_src` (a rank in `group`)."""
    if arguments.get(key) is not None:
        return int(arguments[key])
    return dist.get_global_rank(group, int(arguments[f"group_{key}"]))


def _resolved(group):
    """The group a call runs on: None means the default group (one sequence counter for both spellings)."""
    return group if group is not None else c10d._get_default_group()
