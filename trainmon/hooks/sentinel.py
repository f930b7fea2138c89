"""The NaN sentinel: a device-side non-finite probe on every module output, module grad, weight grad and updated
weight, every step, whatever `targets` and the statistic switches say.

An activation or activation-grad probe is the tensor's (min, max), one `torch.aminmax` call (on CPU, a finite
sum stands for both, see `probe`): a NaN element makes both NaN, a -Inf makes the min -Inf, a +Inf makes the
max +Inf, so NaN, +Inf, -Inf and both infinities are told apart (a sum is NaN for +Inf plus -Inf). Weights and
weight grads are probed all at once, by their L2 norms in fp32 (one multi-tensor op instead of a call per
parameter: one kernel on an accelerator): NaN exactly when an element is, +Inf when one is ±Inf (its sign is
not probed) or when the norm exceeds ~1.8e19 (its squares are summed in fp32). Probes stay on the device, a
(low, high) pair per probed event in the order of the events (each event's `call_index` is kept in its key),
and join the step's single device->host copy as one stacked tensor. On an accelerator nothing is read on the
host inside the hooks (on CPU, `probe` reads its sum, which waits for nothing, and the pairs are kept as
Python floats); `verdict` reads a pair in the writer thread.
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks.dump_capture import DumpRequest, capture
from trainmon.core.events import BOTH_INF, INF, NAN, NEG_INF, POS_INF
from trainmon.hooks import in_graph
from trainmon.hooks.in_graph import in_backward
from trainmon.core.records import ACTV, ACTV_GRAD, GRAD_UNREDUCED, PARAM_UPDATED, RecordKey, record_key
from trainmon.adapters.base import local_shard
from trainmon.adapters.naming import display_name
from trainmon.hooks.selection import module_places
from trainmon.hooks.state import HookState
from trainmon.engine.buffers import host_values
from trainmon.hooks.tensor_memo import TensorMemo
from trainmon.hooks.tensor_select import TAP_ROOT, floating_leaves, input_values

NORM_PROBED = frozenset((GRAD_UNREDUCED, PARAM_UPDATED))  # families probed by an L2 norm: no Inf sign
_WIDE = (torch.float32, torch.float64)  # summed in their own dtype; narrower ones in fp32


def probe(tensor: torch.Tensor) -> tuple:
    """(min, max) of `tensor`: NaN if an element is, else they hold its infinities. Device scalars in its dtype
    on an accelerator; Python floats on CPU.

    On CPU, where reading a value waits for no device, a finite sum stands for both (a sum is 3-5 times
    cheaper than aminmax there on large fp32 tensors); only a tensor whose sum is not finite takes aminmax.
    Values are read by `tolist`, which dispatches no op (`item` would dispatch `_local_scalar_dense`, the op
    that reads a device value on the host), and kept as floats: a step's hundreds of scalar tensors would
    cost a stack of them, several times the cost of the reads. Only a tensor that requires grad (a forward
    output) is detached first: the op would otherwise be recorded in its graph."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cpu:
        total = (tensor.sum() if tensor.dtype in _WIDE else tensor.sum(dtype=torch.float32)).tolist()
        if math.isfinite(total):
            return total, total
        low, high = torch.aminmax(tensor)
        return low.tolist(), high.tolist()
    return torch.aminmax(tensor)


def norm_probes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """fp32 L2 norms of `tensors` (fp64 ones in fp64): non-finite iff an element is, or the norm overflows."""
    if torch.float64 not in {t.dtype for t in tensors}:
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return [torch.linalg.vector_norm(t) if t.dtype == torch.float64 else torch.linalg.vector_norm(t, dtype=torch.float32)
            for t in tensors]


def verdict(family: str, low: float, high: float) -> Optional[str]:
    """What a probe pair found: None (finite), NAN, POS_INF, NEG_INF, BOTH_INF, or INF for a norm-probed
    family (an Inf of either sign, or a norm past fp32's range)."""
    if low != low or high != high:
        return NAN
    if family in NORM_PROBED:
        return INF if high == math.inf else None
    neg, pos = low == -math.inf, high == math.inf
    return BOTH_INF if neg and pos else NEG_INF if neg else POS_INF if pos else None


def stacked(values: list[torch.Tensor]) -> torch.Tensor:
    """`torch.stack(values)`, stacked one dtype at a time: a CUDA stack of mixed dtypes copies its inputs one
    kernel each (a bf16 model's activation probes beside the fp32 norms: about a thousand launches per step),
    where a stack of one dtype copies a batch of inputs per kernel. The groups are cast to the promoted dtype
    and put back in the order of `values`."""
    dtypes = {value.dtype for value in values}
    if len(dtypes) == 1:
        return torch.stack(values)
    groups: dict[torch.dtype, list[int]] = {dtype: [] for dtype in dtypes}
    for i, value in enumerate(values):
        groups[value.dtype].append(i)
    dtype = functools.reduce(torch.promote_types, groups)
    parts = [torch.stack([values[i] for i in members]).to(dtype) for members in groups.values()]
    position = [0] * len(values)
    for at, i in enumerate(itertools.chain.from_iterable(groups.values())):
        position[i] = at
    return torch.cat(parts).index_select(0, host_values(position, parts[0].device))


class _Probes:
    """One step's probes, a (low, high) pair per key: device scalars, stacked into one tensor when the step's
    probes are read, or Python floats for tensors on CPU.

    A list append per probe is the cheapest write: a preallocated buffer would cost an indexing op and
    a copy per probe, where the stack costs under a microsecond per probe once per step.
    """

    def __init__(self):
        self.keys: list[RecordKey] = []
        self._values: list = []

    def add(self, key: RecordKey, tensor: torch.Tensor) -> None:
        self.keys.append(key)
        self._values.extend(probe(tensor))

    def add_norms(self, keys: list[RecordKey], tensors: list[torch.Tensor]) -> None:
        self.keys.extend(keys)
        norms = norm_probes(tensors)
        if norms[0].is_cpu:
            norms = torch.stack(norms).tolist()
        pairs = [None] * (2 * len(norms))  # (norm, norm) each
        pairs[0::2] = norms
        pairs[1::2] = norms
        self._values += pairs

    def filled(self) -> Optional[torch.Tensor]:
        """The probes written this step, [keys, 2] in key order, or None: on the device of the probes that are
        device scalars, in fp64 on CPU when all are floats. Not cast to fp32: an fp64 tensor's finite extremes
        may exceed its range (`stacked` promotes mixed dtypes exactly)."""
        values = self._values
        if not values:
            return None
        on_device = [v for v in values if isinstance(v, torch.Tensor)]
        if not on_device:
            return torch.tensor(values, dtype=torch.float64).view(-1, 2)
        if len(on_device) < len(values):  # CPU tensors probed beside an accelerator's: their floats in one copy
            floats = [v for v in values if not isinstance(v, torch.Tensor)]
            moved = iter(torch.tensor(floats, dtype=torch.float64).to(on_device[0].device, non_blocking=True))
            values = [v if isinstance(v, torch.Tensor) else next(moved) for v in values]
        return stacked(values).view(-1, 2)

    def reset(self) -> None:
        self.keys = []
        self._values = []


class _GradConsumer:
    """Who a tensor's grad is attributed to: the innermost module that took the tensor as input. Registered as
    a pre-hook on the node that made the tensor (output `output_nr` of it), or handed the grad by the compiled
    graph that tapped it (`output_nr` 0), it hands itself and the grad to `on_grad`: one object per watched
    tensor, living until backward."""

    __slots__ = ("tensor", "output_nr", "name", "vpp_stage", "micro", "on_grad")

    def __init__(self, tensor: torch.Tensor, output_nr: int, name: str, vpp_stage: int, micro: int,
                 on_grad: Callable):
        self.tensor, self.output_nr = weakref.ref(tensor), output_nr
        self.name, self.vpp_stage, self.micro, self.on_grad = name, vpp_stage, micro, on_grad

    def __call__(self, grads: tuple) -> None:
        grad = grads[self.output_nr]
        if grad is not None:
            self.on_grad(self, grad)


class NanSentinel(Hooks):
    """Installs the sentinel's hooks; `step_finished()` adds the step's probes to the collector.

    Only training forwards are probed (see `forward_passes`). Forward: the model's floating inputs, before
    any module runs (a NaN that came with the batch is first there), and every module's floating outputs
    are probed. Backward: the grad of every floating module input is probed once, by a pre-hook on the
    autograd node that made the tensor, and named `<module>.input[_i]` after the innermost module that
    took the tensor (it is that module's grad_input, i.e. what its backward computed; a fault injected
    by a full backward hook is seen too). A chunk's root also probes the grad of its outputs, for what
    reaches the model from the loss. Node pre-hooks are used instead of full backward hooks, which wrap
    every module's inputs and outputs in extra autograd nodes and cost more than the probes themselves.
    Inside a compiled region the graph hands back the grad of the first call that took the tensor (the
    outermost; see `in_graph.GraphCall.origin`), named after the innermost.

    Args:
        state: the shared hook state (collector, forward micro-step).
        modules: (name, module, vpp_stage) of every module of every model chunk.
        params: (name, parameter, vpp_stage) of every trainable parameter; its grad is read from
            `param.main_grad` when that exists (Megatron), else `param.grad`.
    """

    collects = "the NaN sentinel"

    def __init__(self, state: HookState, modules: list[tuple], params: list[tuple]):
        self.state = state
        self.modules = modules
        self._params_of: dict[int, list[tuple]] = {}  # vpp stage -> (name, parameter), stages ascending
        for name, param, vpp in sorted(params, key=lambda p: p[2]):
            self._params_of.setdefault(vpp, []).append((name, param))
        self.probes = _Probes()
        self._handles: list = []
        self._consumers: dict[int, _GradConsumer] = {}
        self._graph_consumers: dict[tuple, _GradConsumer] = {}  # by the tensor's first tap in a compiled region
        self._probed = TensorMemo()  # id -> version, of the forward tensors probed this step
        self._graph_probed: set[tuple] = set()  # first taps of those probed inside compiled regions
        self._in_pass: dict[int, int] = {}  # vpp stage -> micro-step, of the grads seen in the running backward pass
        self._callback_queued = False
        self._grad_hook = state.guarded("NaN sentinel on activation grads", self._on_grad)
        self._dump: Optional[_ForwardDump] = None

    def enable_dump(self, deliver: Callable[[DumpRequest], None], rank: int) -> None:
        """Saves the inputs and outputs of the first module with a non-finite forward output, once.

        This reads the probes on the host at the end of every forward pass until the dump is taken
        (one synchronisation per micro-batch): the tensors are gone by the end of the step.
        """
        self._dump = _ForwardDump(deliver, rank)

    def install(self) -> None:
        for name, module, vpp in self.modules:
            item = f"NaN sentinel on {name or '<root>'}"
            self._handles.append(in_graph.around_forward(
                module, "sentinel", self.state.guarded(item, self._make_pre_forward(name, vpp)),
                self.state.guarded(item, self._make_forward(name, vpp)), grads=in_graph.INPUT_GRADS,
                active=self._probing))

    def _probing(self) -> bool:
        """Whether the running forward pass is probed, a training one: the wrapper of a module's forward skips these
        hooks in an evaluation forward (a validation loop, a model's `generate`)."""
        return self.state.training_forward

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._consumers.clear()
        self._graph_consumers.clear()
        self._probed.clear()
        self._graph_probed.clear()
        self.probes.reset()

    # ------------------------------------------------------------------------------------ hooks
    def _probe_one(self, family: str, name: str, tensor: torch.Tensor, vpp_stage: int, micro: Optional[int],
                   index: Optional[int] = None) -> None:
        if tensor.numel():
            if index is None:
                index = self.state.collector.call_index_of(family, name, vpp_stage, micro, tensor)
            key = record_key(family, name, vpp_stage, micro, index, tuple(tensor.shape), tensor.dtype)
            self.probes.add(key, tensor)

    def _probe_weights(self, family: str, leaves: list, vpp_stage: int, micro: Optional[int]) -> None:
        """One probe per (name, tensor) of `leaves`, taken together (see `norm_probes`), with grad off (parameters
        require it; one switch costs less than a detached alias of each). A sharded tensor (FSDP2's DTensors) is
        probed by this rank's shard, keyed by its full shape."""
        leaves = [(name, tensor) for name, tensor in leaves if tensor is not None and tensor.numel()]
        if leaves:
            next_call_index = self.state.collector.next_call_index
            keys = [record_key(family, name, vpp_stage, micro, next_call_index(), t.shape, t.dtype)
                    for name, t in leaves]
            with torch.no_grad():
                self.probes.add_norms(keys, [local_shard(t) for _, t in leaves])

    def _probe_first_sights(self, leaves: list, vpp_stage: int, micro: int, root: bool = False) -> None:
        """Probes the forward tensors not already probed unchanged this step: a container returning its last
        child's output (nn.Sequential, a model returning its head's output) is not read twice. A tensor a compiled
        region made, where the container is handed another buffer, is known by its first tap."""
        probed, graph = self._probed, in_graph.graph_call()
        for name, tensor in leaves:
            origin = _graph_origin(tensor, graph, root)
            if origin is not None:
                if origin in self._graph_probed:
                    continue
                self._graph_probed.add(origin)
            elif probed.get(id(tensor), tensor) == tensor._version:
                continue
            else:
                probed.put(id(tensor), tensor, tensor._version)
            self._probe_one(ACTV, name, tensor, vpp_stage, micro)

    def probe_saved(self, family: str, name: str, tensor: torch.Tensor, micro: int, index: int) -> None:
        """Probes a variable given to `trainmon.save` (or its grad, `save_grad`), under the call index of its
        record."""
        self._probe_one(family, name, tensor, 0, micro, index)

    def _make_pre_forward(self, name: str, vpp: int):
        state = self.state
        prefix, root = f"{name}.input", name == ""

        def pre_forward_hook(module, args, kwargs):
            if not state.training_forward or in_backward():
                return
            if self._dump is not None:
                self._dump.saw(name, "input", args, start=len(self.probes.keys) if root else None)
            grad_enabled = torch.is_grad_enabled()
            if not (root or grad_enabled):  # only the root probes its inputs; the others watch their grads
                return
            micro = state.forward_micro(vpp)
            inputs = floating_leaves(input_values(args, kwargs), None, prefix)
            if root:
                self._probe_first_sights(inputs, vpp, micro)
            if grad_enabled:
                self._watch_grads(inputs, vpp, micro)

        return pre_forward_hook

    def _watch_grads(self, leaves: list, vpp: int, micro: int) -> None:
        """Watches the grads of the (name, tensor) `leaves` made in this forward (the hook goes with its graph), or
        handed back by the compiled graph running the call."""
        graph = in_graph.graph_call()
        for name, tensor in leaves:
            if graph is not None:
                if graph.takes_grad(tensor):
                    self._watch_graph_grad(graph, tensor, name, vpp, micro)
            elif tensor.grad_fn is not None:
                self._watch_grad(tensor, name, vpp, micro)

    def _watch_grad(self, tensor: torch.Tensor, name: str, vpp: int, micro: int) -> None:
        # Known by the tensor an activation-grad tap's alias stands for: each module it reaches gets its own alias.
        root = getattr(tensor, TAP_ROOT, tensor)
        consumer = self._consumers.get(id(root))
        if consumer is not None and consumer.tensor() is root:
            # An inner module took the same tensor (pre-hooks run outside-in): the grad is its grad_input.
            consumer.name, consumer.vpp_stage, consumer.micro = name, vpp, micro
            return
        consumer = _GradConsumer(root, tensor.output_nr, name, vpp, micro, self._grad_hook)
        self._consumers[id(root)] = consumer
        tensor.grad_fn.register_prehook(consumer)  # lives as long as the graph

    def _watch_graph_grad(self, graph: in_graph.GraphCall, tensor: torch.Tensor, name: str, vpp: int,
                          micro: int) -> None:
        """`_watch_grad` inside a compiled region: the first call that tapped the tensor (the outermost) hands back
        its grad, the sum of what every module inside that call added to it."""
        origin = graph.origin(tensor)
        consumer = self._graph_consumers.get(origin)
        if consumer is not None:
            consumer.name, consumer.vpp_stage, consumer.micro = name, vpp, micro
            return
        consumer = self._graph_consumers[origin] = _GradConsumer(tensor, 0, name, vpp, micro, self._grad_hook)
        graph.on_grads([tensor], consumer)

    def _on_grad(self, consumer: _GradConsumer, grad: torch.Tensor) -> None:
        self._ensure_end_of_backward()
        vpp = consumer.vpp_stage
        self._in_pass[vpp] = max(self._in_pass.get(vpp, 0), consumer.micro)
        self._probe_one(ACTV_GRAD, consumer.name, grad, vpp, consumer.micro)

    def _make_forward(self, name: str, vpp: int):
        state = self.state
        prefix, root = f"{name}.output", name == ""

        def forward_hook(module, args, kwargs, output):
            if not state.training_forward or in_backward():
                return
            micro = state.forward_micro(vpp)
            leaves = floating_leaves(output, None, prefix)
            self._probe_first_sights(leaves, vpp, micro, root)
            if self._dump is not None:
                self._dump.saw(name, "output", output)
                if root:
                    self._dump.check(self.probes, state.collector.step, micro)
            if root and torch.is_grad_enabled():
                self._watch_grads(leaves, vpp, micro)

        return forward_hook

    def _ensure_end_of_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(
                self.state.guarded("NaN sentinel on weight grads", self._end_of_backward))

    @staticmethod
    def _grad(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        main_grad = getattr(param, "main_grad", None)
        return main_grad if main_grad is not None else param.grad

    def _end_of_backward(self) -> None:
        """Probes the weight grads, as accumulated so far, of the chunks whose backward this pass ran, under
        the micro-step of the forward whose graph it ran (an interleaved pipeline schedule runs one chunk's
        backward per pass, not in the order of the forwards)."""
        self._callback_queued = False
        in_pass, self._in_pass = self._in_pass, {}
        for vpp in sorted(in_pass):
            grads = [(name, self._grad(p)) for name, p in self._params_of.get(vpp, ())]
            self._probe_weights(GRAD_UNREDUCED, grads, vpp, in_pass[vpp])

    # ----------------------------------------------------------------------------- step cycle
    def step_finished(self, collected: bool) -> None:
        """Probes the updated weights and hands the step's probes to the collector (training thread)."""
        for vpp, params in self._params_of.items():
            self._probe_weights(PARAM_UPDATED, params, vpp, None)
        filled = self.probes.filled()
        if filled is not None:
            self.state.collector.add_flags(self.probes.keys, filled)
        self.probes.reset()
        self._consumers.clear()
        self._graph_consumers.clear()
        self._probed.clear()
        self._graph_probed.clear()
        self._in_pass.clear()

    @property
    def pending(self) -> bool:
        """Whether probes of the running step are waiting for `step_finished`."""
        return bool(self.probes.keys)

    def finish(self) -> None:
        """An unfinished step (a loop that stopped on a NaN loss before optimizer.step) keeps its probes."""
        if self.pending:
            self.step_finished(collected=True)

    def any_nonfinite(self) -> Optional[torch.Tensor]:
        """Device bool: whether a probe of this step so far is non-finite (None when none was taken)."""
        filled = self.probes.filled()
        return None if filled is None else ~torch.isfinite(filled).all()


def _graph_origin(tensor: torch.Tensor, graph: Optional[in_graph.GraphCall], root: bool) -> Optional[tuple]:
    """The first tap of `tensor` where a compiled region made it (`GraphCall.origin`): inside the region (`graph`
    runs the hook), or as the region's output at a root whose hooks run outside it; None elsewhere."""
    if graph is not None:
        return graph.origin(tensor) if graph.takes_grad(tensor) else None
    grad_fn = tensor.grad_fn if root else None
    outer = None if grad_fn is None else in_graph.graph_output_call(tensor, grad_fn)
    return None if outer is None else outer.origin(tensor)


def nan_sentinel(state: HookState, chunks: list[torch.nn.Module], squash_name: bool,
                 rename: Callable[[int, str], str]) -> NanSentinel:
    """The sentinel over every module and trainable parameter of the model chunks (vpp stage = index).

    `rename(vpp_stage, name)` is the adapter's: the sentinel writes the names every other family writes
    (e.g. Megatron's global layer numbers, so stage 1's `layers.0` does not collide with stage 0's).
    """
    modules = [(rename(vpp, place), module, vpp)  # a wrapper chain that squash_name folds is probed once
               for vpp, chunk in enumerate(chunks) for place, _, module in module_places(chunk, squash_name)]
    params = [(rename(vpp, display_name(name, squash_name)), param, vpp)
              for vpp, chunk in enumerate(chunks) for name, param in chunk.named_parameters() if param.requires_grad]
    return NanSentinel(state, modules, params)


class _ForwardDump:
    """Weak references to each module's inputs and outputs in the running forward pass; at its end, the
    first non-finite forward probe names the module whose tensors are copied out (see enable_dump)."""

    def __init__(self, deliver: Callable[[DumpRequest], None], rank: int):
        self.deliver = deliver
        self.rank = rank
        self.done = False
        self._first_slot = 0
        self._io: dict[str, list] = {}

    def saw(self, module: str, kind: str, obj, start: Optional[int] = None) -> None:
        if self.done:
            return
        if start is not None:  # the root's pre-hook: a new forward pass
            self._first_slot = start
            self._io.clear()
        leaves = [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]
        self._io.setdefault(module, []).extend(
            (f"{kind}_{i}" if len(leaves) > 1 else kind, weakref.ref(t)) for i, t in enumerate(leaves))

    def check(self, probes: _Probes, step: int, micro: int) -> None:
        if self.done:
            return
        filled = probes.filled()
        if filled is None or len(filled) <= self._first_slot:
            return
        bad = ~torch.isfinite(filled[self._first_slot:]).all(1)
        if not bool(bad.any()):  # the documented host read
            return
        key = probes.keys[self._first_slot + int(bad.nonzero()[0, 0])]
        if key.family != ACTV:
            return
        module = key.name.rpartition(".")[0]
        tensors = [(name, ref()) for name, ref in self._io.get(module, []) if ref() is not None]
        request = DumpRequest(rank=self.rank, step=step, micro_step=micro, module=module, phase="forward")
        capture(request, tensors)
        self.done = True
        self._io.clear()
        self.deliver(request)
