"""trainmon's forward hooks inside `torch.compile`d regions and captured graphs.

Dynamo runs a compiled module's own hooks outside its graph, but traces the hooks of every module inside the
region into it. The eager hook bodies cannot be traced: their bookkeeping (micro-steps, call indices, names,
reuse by tensor identity, step gating) reads Python state that Dynamo would turn into graph breaks, or into
guards that recompile every micro-step. So every forward hook trainmon registers goes through
`forward_pre_hook` / `forward_hook` / `around_forward` here: in eager mode it is the hook itself; under tracing
it becomes one op of the graph, `trainmon::observe`, which receives the call's tensors (detached) and, when the
graph runs, runs the same hook on them, in program order. The eager code then names and counts the event
exactly as it would have without compile, and the records are the same.

Nothing of the hook's own state is read while tracing. The module is named to the op by a scalar tensor
attribute (`_trainmon_token`), a graph input: an int constant would be a guard, and a model compiled block by
block (torchtitan) would compile one graph per block instead of one for all of them.

Grads: a compiled region's backward is one autograd node, so the grad hooks an eager hook puts on a call's
tensors never run there. Where a hook watches grads (`grads`), the traced call passes its tensors that require
grad (the inputs before its forward, the output leaves after it, as the hooks ask) through one identity autograd
function, `_GradTap`, whose backward hands their grads to a second ordered op, `trainmon::observe_grads`; the
compiled backward runs it where autograd would have run the eager hooks, in the same order. The eager hook asks for them
at forward time (`graph_call`); the op that ran it returns a scalar tensor carrying that request, which the tap
saves for the backward, so each backward finds its own call's request, whatever order the micro-batches' backward
passes run in. A call's input that an enclosing call tapped already (a block's input, taken by its first layer) is
tapped again, for the call's own grad, and the hook learns which tap it came through (`GraphCall.origin`): where
eager hooks key a tensor by its identity, the graph's buffers have none.

Each op costs the compiled forward about as much as the hook it runs (its dispatch, its kernel's entry, inductor's
checks of its result). A leaf call, one that runs no hooked module inside it, is traced with one op after its
forward, which runs its befores and then its afters: nothing hooked runs between them, so the call order is the
eager one. Its inputs' taps, which must go before the forward, save a new empty tensor made there, to which the op
attaches their requests (`_observe_leaf_in_graph`).

A forward pass in which no hook that has an `active` has anything to do (a step that is not collected, an evaluation
forward) is traced without those hooks' ops and taps, so that its steps cost what unmonitored ones do: a compiled
module's wrapper, which runs eagerly before its graph, asks them once and sets `_graph_idle`, which the traced calls
read and Dynamo guards on (`_compiled_forward`). Such forward passes run a second graph, compiled once.

CUDA graphs (and an NPU's graph capture): a Python op under stream capture runs once, at capture, and never at
replay. Rather than record nothing silently, a hook that runs under capture (traced or eager) records nothing and
says so once. Inductor is told (`Tag.cudagraph_unsafe`), so `mode="reduce-overhead"` runs the op outside what it
captures.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import logging
import types
import weakref
from typing import Callable, NamedTuple, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from trainmon.adapters.naming import compiled_name
from trainmon.engine.accelerator import stream_capturing
from trainmon.hooks.tensor_select import input_places, input_values

logger = logging.getLogger("trainmon")

_TOKEN = "_trainmon_token"
# (module token, kind's number) -> (weak module, eager hook, with_kwargs, with_output, active): `active()` False (None:
# always True) where the hook has nothing to do, so `trainmon::observe` returns before any work
_hooks: dict[tuple[int, int], tuple] = {}
_kinds: dict[str, int] = {}  # each hook kind's number, the one `trainmon::observe` is given
_tokens = itertools.count()
_said: set[str] = set()  # messages said since the first hook was registered
_on_graph_buffers = 0  # depth of eager hooks running inside `trainmon::observe` (see `graph_buffers`)
_graph_call: Optional["GraphCall"] = None  # the traced call whose hooks are running (see `graph_call`)
# Registered hooks that watch the grads of calls' inputs, and of their outputs: while there are some, traced calls
# tap those tensors. A tap costs a compiled backward more than the hook's work on the grad (the grad leaves the
# backward's fused kernels for the op): only those the hooks take are tapped.
INPUT_GRADS, ALL_GRADS = ("inputs",), ("inputs", "outputs")
_grad_watchers = {"inputs": 0, "outputs": 0}
# The `active` of every registered hook that has one, with how many registrations hold it (a few hook groups, each
# with one `active` for all its modules).
_gates: dict[Callable[[], bool], int] = {}
# True while a compiled module's forward runs from its eager wrapper in a forward pass where no `active` answered
# True (a step that is not collected, an evaluation forward): traced calls then put no op in the graph for hooks
# that have an `active`, nor tap their grads. Dynamo guards on this value, so such forward passes run a graph of
# their own, compiled once, whose steps cost what an unmonitored step costs; the others run the graph with the ops.
_graph_idle = False
_CALL = "_trainmon_call"  # the attribute of `trainmon::observe`'s result that holds its `GraphCall`
# The attribute of a traced output leaf passed through `_GradTap` (set while tracing): (that call's
# `trainmon::observe` result, the leaf's place among its tapped tensors).
_TAPPED_OUTPUT = "_trainmon_tapped_output"
# The same for a traced input passed through `_GradTap`, naming the first call that tapped the tensor (the calls
# nested in that one tap it again).
_TAPPED_INPUT = "_trainmon_tapped_input"


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        logger.warning("trainmon: %s", message)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (where only activation
    checkpointing runs module forwards)."""
    return torch._C._current_graph_task_id() != -1


def graph_buffers() -> bool:
    """Whether the running hook was handed its tensors by a compiled graph (`trainmon::observe`). They are the
    graph's buffers, which its later kernels may overwrite as soon as the op returns (inductor reuses the memory
    of dead intermediates, without bumping a version counter): the hook reads them before it returns."""
    return _on_graph_buffers > 0


class GraphCall:
    """The tensors of one traced call whose grads the compiled backward hands back: the hook that
    `trainmon::observe` runs asks for them (`on_grads`), and gets them when the backward computes them.

    Those the call passed through `_GradTap` come with its backward. An output leaf that is already an inner
    call's tapped output (a module returning its last submodule's output) is not tapped again: its grad comes
    with that inner call's, after the inner hook's, which is the order in which eager grad hooks on one tensor run.
    """

    __slots__ = ("_tapped", "_joined", "_origins", "_wanted")

    def __init__(self, tapped: list[torch.Tensor], joined: list[tuple[torch.Tensor, "GraphCall", int]],
                 origins: list[tuple[torch.Tensor, "GraphCall", int]] = ()):
        # id of each tensor it tapped -> its place among them. No entry holds the call itself: a call in a cycle would
        # outlive its graph, for Python's garbage collector to find, with what it holds (hundreds of objects a step)
        self._tapped = {id(t): i for i, t in enumerate(tapped)}
        # id of each tensor an inner call tapped -> (that call, whose backward hands back its grad, its place there)
        self._joined = {id(t): (call, i) for t, call, i in joined}
        # id of each tapped tensor that an enclosing call tapped first -> (that call, the tensor's place there)
        self._origins = {id(t): (call, i) for t, call, i in origins}
        self._wanted: list[tuple[int, tuple[int, ...], Callable]] = []  # (count, places, callback), `deliver`

    def takes_grad(self, tensor: torch.Tensor) -> bool:
        """Whether the compiled backward hands back the grad of `tensor` (one the hook was given)."""
        return id(tensor) in self._joined or id(tensor) in self._tapped

    def _where(self, tensor: torch.Tensor) -> tuple["GraphCall", int]:
        """(the call whose backward hands back the grad of `tensor`, its place among that call's tapped)."""
        joined = self._joined.get(id(tensor))
        return (self, self._tapped[id(tensor)]) if joined is None else joined

    def origin(self, tensor: torch.Tensor) -> tuple["GraphCall", int]:
        """The first tap of `tensor` (one that `takes_grad`) in the running forward: (the call, its place there).
        Two hooks' inputs with one origin are one tensor of the traced program: the graph's buffers are not."""
        return self._origins.get(id(tensor)) or self._where(tensor)

    def on_grads(self, tensors: list[torch.Tensor], callback: Callable[[list], None]) -> None:
        """Calls `callback(grads)` in the compiled backward, `grads[i]` being that of `tensors[i]` (each one that
        `takes_grad`), None where no grad reached it; once per call that hands some of them back."""
        by_call: dict = {}
        for k, t in enumerate(tensors):
            call, i = self._where(t)
            by_call.setdefault(call, []).extend((k, i))
        for call, places in by_call.items():
            call._wanted.append((len(tensors), tuple(places), callback))

    def deliver(self, grads: list) -> None:
        """Hands each request its grads: its `places` pair each requested tensor's position with its grad's in
        `grads`, flat (k0, i0, k1, i1, ...)."""
        for count, places, callback in self._wanted:
            wanted = [None] * count
            for j in range(0, len(places), 2):
                wanted[places[j]] = grads[places[j + 1]]
            callback(wanted)


def graph_output_call(tensor: torch.Tensor, grad_fn) -> Optional[GraphCall]:
    """Where `tensor` (whose `grad_fn` is given) is an output of a compiled region that a call inside the region
    tapped: a `GraphCall` that hands back its grad with that call's, after it (see `GraphCall`); None otherwise.
    An eager hook on a module returning that tensor (a compiled model's root) asks there."""
    if type(grad_fn).__name__ != _COMPILED_BACKWARD:
        return None
    tapped = getattr(tensor, _TAPPED_OUTPUT, None)
    inner = None if tapped is None else getattr(tapped[0], _CALL, None)
    return None if inner is None else GraphCall([], [(tensor, inner, tapped[1])])


_COMPILED_BACKWARD = "CompiledFunctionBackward"  # AOTAutograd's one autograd node for a compiled region


def graph_call() -> Optional[GraphCall]:
    """The traced call whose hook is running, where that hook was handed its tensors by a compiled graph and the
    graph passed some of them through `_GradTap` (see the module doc); None otherwise."""
    return _graph_call


# Dynamo's frame callback, None outside a compiled call; a torch release without this query reports one always (the
# hooks then always go through Dynamo's disable wrapper).
_dynamo_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: "unknown")


# `stream_capturing` is called by the eager hooks of a compiled module, where Dynamo would compile it as a frame of
# its own: the accelerator's query is not traceable, and a `fullgraph=True` compile would fail on it.
torch._dynamo.eval_frame.skip_code(stream_capturing.__code__)


CAPTURE_REFUSED = ("a graph is being captured on the accelerator's stream (CUDA graphs, an NPU's graph capture): "
                   "hooks that run during capture would run only then, never at "
                   "replay, so nothing of the captured region is recorded (activations, activation grads and "
                   "the NaN sentinel's probes there); weight grads and optimizer state outside it still are")
SUBGRAPH_GRADS_REFUSED = ("grads of activations made inside activation checkpointing (or another higher-order op) "
                          "of a torch.compile'd region are not collected (torch recomputes what such a region saves "
                          "for its backward, and would run trainmon's hooks again there); those outside it are")

RECOMPUTED_GRADS_REFUSED = ("grads of activations made inside a torch.compile'd module run under activation "
                            "checkpointing are not collected (torch runs its graph again in the backward, and that "
                            "run carries none of the forward's requests for them); those of the module's own inputs "
                            "and outputs, and of every module outside it, are")


# The two ops are defined through `torch.library.Library`, with their Python kernels as the dispatcher's own, not
# through `torch.library.custom_op`, whose wrappers (an autograd function, a redispatch, alias checks, Dynamo's
# disable wrapper) cost about 15 µs a call more: 20.6 against 5.9 µs for a kernel that only makes its result, where
# a hooked call runs two or three of them. The dispatcher parses every argument of every call, lists included:
# `observe`'s integers travel in one list (`_Layout`), which halves its call (5.4 against 10.3 µs with one list
# for each).
_LIBRARY = torch.library.Library("trainmon", "FRAGMENT")
_LIBRARY.define("observe(Tensor token, Tensor[] inputs, Tensor[] outputs, Tensor[] calls, int[] layout) -> Tensor",
                tags=(torch.Tag.cudagraph_unsafe,))
_LIBRARY.define("observe_grads(Tensor call, Tensor?[] grads) -> ()", tags=(torch.Tag.cudagraph_unsafe,))


class _Site(NamedTuple):
    """What `trainmon::observe`'s integers say of one traced call site (see `_observe`)."""

    kind: int  # the hook's kind (its number)
    grad_enabled: bool
    untapped: bool  # grads were watched, but the call was traced inside a higher-order op (`_in_subgraph`)
    carried: bool  # its inputs' taps save the last of `calls`, made for them before the forward, not its result
    out_total: int  # the output's leaf count
    out_positions: tuple  # the output's tensor leaves' positions among its leaves
    tapped_out: tuple  # positions among the outputs of those passed through `_GradTap`
    joined: tuple  # positions among the outputs of an inner call's tapped outputs,
    joined_places: tuple  # with their places among that call's tapped
    tapped_in: tuple  # positions among the inputs of those passed through `_GradTap`
    retapped: tuple  # positions among the inputs of the tapped that an enclosing call tapped first,
    origin_places: tuple  # with their places among that call's tapped


class _Layout:
    """`trainmon::observe`'s integers, in one list: the hook's kind, its flags, the output's leaf count, then the
    counts and contents of the lists of a `_Site`. Its `calls` argument holds the joined calls' results, then the
    retapped calls', then the carrier of its inputs' taps where `carried`."""

    HEAD = 8  # kind, flags, out_total and the five counts

    @staticmethod
    def pack(kind: int, grad_enabled: bool, untapped: bool, carried: bool, out_total: int, out_positions: list[int],
             tapped_out: list[int], joined: list[int], joined_places: list[int], tapped_in: list[int],
             retapped: list[int], origin_places: list[int]) -> list[int]:
        return [kind, int(grad_enabled) | int(untapped) << 1 | int(carried) << 2, out_total, len(out_positions),
                len(tapped_out), len(joined), len(tapped_in), len(retapped), *out_positions, *tapped_out, *joined,
                *joined_places, *tapped_in, *retapped, *origin_places]

    @staticmethod
    def unpack(layout: list[int]) -> _Site:
        """Unpacked once per traced call site, whose every run passes the same list."""
        key = tuple(layout)
        site = _unpacked.get(key)
        if site is None:
            site = _unpacked[key] = _Layout._unpack(key)
        return site

    @staticmethod
    def _unpack(layout: tuple) -> _Site:
        kind, flags, out_total, *counts = layout[:_Layout.HEAD]
        n_positions, n_tapped_out, n_joined, n_tapped_in, n_retapped = counts
        lists, at = [], _Layout.HEAD
        for n in (n_positions, n_tapped_out, n_joined, n_joined, n_tapped_in, n_retapped, n_retapped):
            lists.append(layout[at:at + n])
            at += n
        return _Site(kind, bool(flags & 1), bool(flags & 2), bool(flags & 4), out_total, *lists)


_unpacked: dict[tuple, _Site] = {}  # `_Layout.unpack`'s answers, by layout: one per traced call site


def _kernel(name: str, fn: Callable) -> None:
    """Registers `fn` as op `name`'s kernel for every device. Dynamo would compile the frames it calls where its frame
    callback is set (a backward run inside a compiled function); there `fn` runs with Dynamo off."""
    off = torch._dynamo.disable(fn, recursive=True)

    def kernel(*args):
        return (fn if _dynamo_frame_callback() is None else off)(*args)

    torch._dynamo.eval_frame.skip_code(kernel.__code__)
    _LIBRARY.impl(name, kernel, "CompositeExplicitAutograd")


# `trainmon::observe`'s result where no grad of the call is tapped. A new result is made like it: `empty_like` costs
# about half of `empty` (0.8 against 1.5 µs).
_NO_CALL = torch.empty((), dtype=torch.int64)


def _no_call(calls: list[torch.Tensor]) -> torch.Tensor:
    """The result of a call that carries no request. A custom op's result may alias none of its inputs (torch
    checks it at a compiled function's first run, an error where `CI` is set), and `calls` may hold `_NO_CALL`."""
    return torch.empty_like(_NO_CALL) if calls else _NO_CALL


def _observe(token: torch.Tensor, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
             calls: list[torch.Tensor], layout: list[int]) -> torch.Tensor:
    """Runs the eager hook (`layout`'s kind) of the module `token` names on the tensors of one call (see the module
    doc; `layout` says which of them were tapped, see `_Site`). A leaf call's one op (`_observe_leaf_in_graph`) runs
    the module's befores, then its afters. Returns the scalar that the call's own taps save for the backward,
    carrying the hooks' requests for their grads."""
    entry = _hooks.get((int(token), layout[0]))
    if entry is None:
        return _no_call(calls)  # removed since the graph was traced
    module_ref, hook, with_kwargs, with_output, active = entry
    if active is not None and not active():  # a step that is not collected: the op's cost is its dispatch alone
        return _no_call(calls)
    site = _Layout.unpack(layout)
    module = module_ref()
    if module is None:
        return _no_call(calls)
    if stream_capturing():
        _say_once(CAPTURE_REFUSED)
        return _no_call(calls)
    if site.untapped:
        _say_once(SUBGRAPH_GRADS_REFUSED)
    elif (site.tapped_in or site.tapped_out) and in_backward():
        _say_once(RECOMPUTED_GRADS_REFUSED)  # the forward run again in a backward: the hooks ask for nothing there
    args = (tuple(inputs), {}) if with_kwargs else (tuple(inputs),)
    if with_output:
        leaves: list = [None] * site.out_total
        for position, tensor in zip(site.out_positions, outputs):
            leaves[position] = tensor
        args += (leaves[0] if site.out_total == 1 else leaves,)
    in_call = _input_call(site, inputs, calls) if site.tapped_in else None
    out_call = None
    if site.tapped_out or site.joined:
        out_call = GraphCall([outputs[i] for i in site.tapped_out],
                             [(outputs[i], getattr(inner, _CALL), place)
                              for i, inner, place in zip(site.joined, calls, site.joined_places)])
    if site.carried:
        setattr(calls[-1], _CALL, in_call)
    own = out_call if with_output else in_call
    if own is not None:
        result = torch.empty_like(_NO_CALL)  # a new tensor: another call may take this one as input
        setattr(result, _CALL, own)
    else:
        result = _no_call(calls)
    global _on_graph_buffers, _graph_call
    outer = _graph_call
    _on_graph_buffers += 1
    # A compiled forward runs its ops with grad off; the hook decides as the traced call would have.
    grad_was = torch.is_grad_enabled()
    torch._C._set_grad_enabled(site.grad_enabled)
    try:
        if isinstance(hook, tuple):  # a leaf call's befores and afters
            _graph_call = in_call
            hook[0](module, *args[:2])
            _graph_call = out_call
            hook[1](module, *args)
        else:
            _graph_call = own
            hook(module, *args)
    finally:
        torch._C._set_grad_enabled(grad_was)
        _on_graph_buffers -= 1
        _graph_call = outer
    return result


def _input_call(site: _Site, inputs: list[torch.Tensor], calls: list[torch.Tensor]) -> GraphCall:
    """The `GraphCall` of a call's tapped inputs."""
    return GraphCall([inputs[i] for i in site.tapped_in], (),
                     [(inputs[i], getattr(outer, _CALL), place)
                      for i, outer, place in zip(site.retapped, calls[len(site.joined):], site.origin_places)])


@torch.library.register_fake("trainmon::observe", lib=_LIBRARY)
def _(token, inputs, outputs, calls, layout) -> torch.Tensor:
    if inputs or outputs:
        _partition_as_unmonitored()
    return torch.empty((), dtype=torch.int64, device="cpu")


def _observe_grads(call: torch.Tensor, grads: list[Optional[torch.Tensor]]) -> None:
    """Hands the grads of a traced call's tapped tensors to the hooks that asked for them (`call`: the scalar that
    carries that call's requests, see `_observe`)."""
    requests = getattr(call, _CALL, None)
    if requests is None:
        return
    if stream_capturing():
        _say_once(CAPTURE_REFUSED)
        return
    global _on_graph_buffers
    _on_graph_buffers += 1
    try:
        requests.deliver(grads)
    finally:
        _on_graph_buffers -= 1


@torch.library.register_fake("trainmon::observe_grads", lib=_LIBRARY)
def _(call, grads) -> None:
    return None


class _GradTap(torch.autograd.Function):
    """Identity on a traced call's tensors; its backward hands their grads to `trainmon::observe_grads`, for the
    requests that `call` carries."""

    @staticmethod
    def forward(ctx, call: torch.Tensor, *tensors):
        ctx.save_for_backward(call)
        # Views of the tensors would make autograd reject in-place ops on them; detached aliases do not.
        return tuple([t.detach() for t in tensors])

    @staticmethod
    def backward(ctx, *grads):
        torch.ops.trainmon.observe_grads(ctx.saved_tensors[0], list(grads))
        return (None,) + grads


# AOTAutograd's partitioner will not recompute, in the backward, a node that the forward uses after an
# unfusible use of that node's input ("used far apart"). The op is such a use of every tensor it observes, placed
# between the tensor and its module's own uses: a LayerNorm's fp32 cast of its bf16 input then counts as used far
# apart, and the fp32 products of LayerNorm and GELU are saved where unmonitored they are recomputed from their
# bf16 inputs (2.33 GB more peak memory on a 12-layer, hidden-2048 GPU model; 29 against 23 MB saved on a
# 2-layer CPU one). So the heuristic is off while a graph holding the op is compiled, and back once it is.
_PARTITION_KEY = "ban_recompute_used_far_apart"
_partition_off = False                          # turned off by a graph holding the op, until the compile's end


def _partition_as_unmonitored() -> None:
    """Turns the heuristic off for the compile under way (called while a graph holding the op is traced)."""
    global _partition_off
    from torch._functorch import config

    handler = getattr(torch._dynamo, "callback_handler", None)    # runs callbacks at each compile's end
    if _partition_off or handler is None or not getattr(config, _PARTITION_KEY, False):
        return
    if not _compile_under_way():                # fake tensors outside a compile: nothing to partition
        return
    if _restore_partition not in handler.end_callbacks:   # torch._dynamo.reset() clears them
        handler.register_end_callback(_restore_partition)
    setattr(config, _PARTITION_KEY, False)
    _partition_off = True


def _compile_under_way() -> bool:
    """Whether Dynamo is compiling in this thread. The fake implementation runs as it is, not traced, when Dynamo
    propagates shapes: `torch.compiler.is_compiling()` says so there only in torch releases that hold it for the
    whole compile (pytorch/pytorch#184614, after 2.11); Dynamo's compile context says so in every release."""
    return torch.compiler.is_compiling() or torch._guards.CompileContext.try_get() is not None


def _restore_partition(_args=None) -> None:
    """At the end of each compile: the heuristic back on, if a graph holding the op turned it off."""
    global _partition_off
    from torch._functorch import config

    if _partition_off:
        setattr(config, _PARTITION_KEY, True)
        _partition_off = False


# Ordered: passes keep the ops in program order among themselves and never drop them as unused.
_kernel("observe", _observe)
_kernel("observe_grads", _observe_grads)
for _op in (torch.ops.trainmon.observe.default, torch.ops.trainmon.observe_grads.default):
    torch.library._register_effectful_op(_op, torch._higher_order_ops.effects._EffectType.ORDERED)


def _observe_in_graph(module: torch.nn.Module, kind: str, args: tuple, kwargs: dict, output=None,
                      with_output: bool = False):
    """The traced form of a hook call: one `trainmon::observe` op (the eager hook runs when it does). While some
    hook watches grads, the call's tensors that require grad (its output's where `with_output`, else its inputs)
    go through `_GradTap`. Returns the call's (args, kwargs), or its output, with those tensors replaced by the
    tap's."""
    inputs = input_values(args, kwargs)
    leaves, spec = tree_flatten(output) if with_output else ([], None)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    grad_enabled = torch.is_grad_enabled()
    watchers = _grad_watchers["outputs" if with_output else "inputs"]
    untapped = bool(watchers) and grad_enabled and _in_subgraph()
    taps = bool(watchers) and grad_enabled and not untapped
    tapped_in, retapped, outer = _input_taps(inputs) if taps and not with_output else ([], [], [])
    outputs = [leaves[i].detach() for i in positions]  # the op's, detached before the taps are chosen
    tapped_out, joined, inner = _output_taps([leaves[i] for i in positions]) if taps and with_output else ([], [], [])
    call = _observe_op(module, kind, grad_enabled, untapped, inputs, len(leaves), positions, outputs,
                       (tapped_out, joined, inner), (tapped_in, retapped, outer))
    if with_output:
        return _tap_outputs(call, leaves, spec, positions, tapped_out) if tapped_out else output
    return _tap_inputs(call, args, kwargs, inputs, tapped_in) if tapped_in else (args, kwargs)


def _observe_leaf_in_graph(module: torch.nn.Module, forward: Callable, args: tuple, kwargs: dict):
    """The traced form of a leaf call (no hooked module runs inside it, `_LEAF`): `forward(*args, **kwargs)`, then
    one `trainmon::observe` op that runs the module's befores and afters, which is what the two ops around the
    forward would have run, in the same order (nothing hooked runs between them). Its inputs' taps go before the
    forward, where no op of the call is: they save an empty tensor made for them there (`_carrier`), to which the
    op attaches their requests. Returns the output, tapped."""
    inputs = input_values(args, kwargs)
    grad_enabled = torch.is_grad_enabled()
    untapped = grad_enabled and bool(_grad_watchers["inputs"] or _grad_watchers["outputs"]) and _in_subgraph()
    tapped_in, retapped, outer = ([], [], [])
    if grad_enabled and _grad_watchers["inputs"] and not untapped:
        tapped_in, retapped, outer = _input_taps(inputs)
    carrier = None
    if tapped_in:
        carrier = _carrier()
        args, kwargs = _tap_inputs(carrier, args, kwargs, inputs, tapped_in)
        inputs = input_values(args, kwargs)
    output = forward(*args, **kwargs)
    leaves, spec = tree_flatten(output)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    outputs = [leaves[i].detach() for i in positions]
    tapped_out, joined, inner = ([], [], [])
    if grad_enabled and _grad_watchers["outputs"] and not untapped:
        tapped_out, joined, inner = _output_taps([leaves[i] for i in positions])
    call = _observe_op(module, "forward.both", grad_enabled, untapped, inputs, len(leaves), positions, outputs,
                       (tapped_out, joined, inner), (tapped_in, retapped, outer), carrier)
    return _tap_outputs(call, leaves, spec, positions, tapped_out) if tapped_out else output


def _observe_op(module: torch.nn.Module, kind: str, grad_enabled: bool, untapped: bool, inputs: list,
                out_total: int, positions: list[int], outputs: list, output_taps: tuple, input_taps: tuple,
                carrier: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Puts one `trainmon::observe` in the graph (see `_observe`): `outputs`, the output's tensor leaves (at
    `positions` among its `out_total` leaves), detached; `output_taps` as `_output_taps` returns them, `input_taps` as
    `_input_taps` does; `carrier`, where the input taps save it (`_carrier`) rather than the result."""
    tapped_out, joined, inner = output_taps
    tapped_in, retapped, outer = input_taps
    site = _Site(_kinds[kind], grad_enabled, untapped, carrier is not None, out_total, positions, tapped_out, joined,
                 [place for _, place in inner], tapped_in, retapped, [place for _, place in outer])
    calls = [c for c, _ in inner] + [c for c, _ in outer] + ([] if carrier is None else [carrier])
    return torch.ops.trainmon.observe(getattr(module, _TOKEN), [t.detach() for t in inputs], outputs, calls,
                                      _Layout.pack(*site))


def _input_taps(inputs: list) -> tuple[list[int], list[int], list[tuple]]:
    """(positions of the inputs to tap: those that require grad; positions of those among them that an enclosing
    call tapped first; the first taps of those: (that call's carrier, the tensor's place there))."""
    tapped, retapped, outer = [], [], []
    for i, t in enumerate(inputs):
        if t.requires_grad:
            tapped.append(i)
            first = getattr(t, _TAPPED_INPUT, None)
            if first is not None:
                retapped.append(i)
                outer.append(first)
    return tapped, retapped, outer


def _output_taps(outputs: list) -> tuple[list[int], list[int], list[tuple]]:
    """(positions of the outputs to tap: those that require grad, not already an inner call's tapped output, and
    not used by the graph already (`_used_in_graph`: the outputs' detached copies for the op are the graph's last
    detaches); positions of the inner calls' tapped outputs, joined; their taps: (that call's result, the tensor's
    place there))."""
    tapped, joined, inner = [], [], []
    used = None
    for i, t in enumerate(outputs):
        if t.requires_grad:
            tapped_output = getattr(t, _TAPPED_OUTPUT, None)
            if tapped_output is not None:
                joined.append(i)
                inner.append(tapped_output)
                continue
            used = _used_in_graph(len(outputs)) if used is None else used
            if not used[i]:
                tapped.append(i)
    return tapped, joined, inner


OUTPUT_USED_REFUSED = ("the grad of a module's output that the module itself uses inside a torch.compile'd region (a "
                       "loss computed inside the forward from the logits it returns) is not collected there: the "
                       "compiled backward adds the grad of that use where no hook sees it; the grads of the "
                       "module that made the tensor are")


@torch._dynamo.assume_constant_result
def _used_in_graph(count: int) -> tuple[bool, ...]:
    """For each of the last `count` tensors detached in the graph being traced (a call's outputs, detached for its
    op): whether the graph already takes the tensor it detached into an op whose result requires grad, so that
    part of its grad is summed inside the compiled backward, where no tap sees it. Run while tracing, its answer a
    constant of the graph (see `_in_subgraph`); said once where some output is."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:                      # traced without Dynamo
        tx = None
    if tx is None:
        return (False,) * count
    detaches = []
    for node in reversed(tx.output.graph.nodes):
        if len(detaches) == count:
            break
        if node.target in _DETACH:
            detaches.append(node)
    if len(detaches) < count:
        return (False,) * count
    used = tuple(any(_takes_grad(user) for user in getattr(node.args[0], "users", ()) if user.target not in _DETACH)
                 for node in reversed(detaches))
    if any(used):
        _say_once(OUTPUT_USED_REFUSED)
    return used


_DETACH = ("detach", torch.Tensor.detach)  # a detach's target in a graph Dynamo traces (a method, or the function)


def _takes_grad(node) -> bool:
    """Whether a node of a graph being traced makes a tensor that requires grad (one of its results, for an op that
    makes several)."""
    values, _ = tree_flatten(node.meta.get("example_value"))
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in values)


def _tap_inputs(call: torch.Tensor, args: tuple, kwargs: dict, inputs: list, tapped: list[int]) -> tuple[tuple, dict]:
    """(args, kwargs) with the `tapped` inputs passed through one `_GradTap` that saves `call`."""
    aliases = _GradTap.apply(call, *[inputs[i] for i in tapped])
    places = input_places(args, kwargs)
    args, kwargs = list(args), dict(kwargs)
    for place, (i, alias) in enumerate(zip(tapped, aliases)):
        setattr(alias, _TAPPED_INPUT, getattr(inputs[i], _TAPPED_INPUT, None) or (call, place))
        positional, key = places[i]
        (args if positional else kwargs)[key] = alias
    return tuple(args), kwargs


def _tap_outputs(call: torch.Tensor, leaves: list, spec, positions: list[int], tapped: list[int]):
    """The output rebuilt from `leaves`, the `tapped` tensor leaves passed through one `_GradTap` that saves `call`."""
    aliases = _GradTap.apply(call, *[leaves[positions[i]] for i in tapped])
    leaves = list(leaves)
    for place, (i, alias) in enumerate(zip(tapped, aliases)):
        setattr(alias, _TAPPED_OUTPUT, (call, place))
        leaves[positions[i]] = alias
    return tree_unflatten(leaves, spec)


def _carrier() -> torch.Tensor:
    """A new tensor of the graph, for a leaf call's input taps to save: made anew each run, as an op's result is.
    AOTAutograd neither merges `empty`s (`fx_graph_cse`) nor makes this one again in the backward (its user there,
    `trainmon::observe_grads`, has effects: what it takes is saved). Without elements, inductor allocates it and
    runs no kernel for it (a scalar got one of its own)."""
    return torch.empty(0, dtype=torch.int64)


@torch._dynamo.assume_constant_result
def _in_subgraph() -> bool:
    """Whether Dynamo is tracing the body of a higher-order op (activation checkpointing, an autograd.Function):
    run while tracing, its answer a constant of the graph. There a tap cannot go: AOTAutograd recomputes in the
    backward what a checkpointed region saves, `trainmon::observe` included (whose result the tap would save), and
    Dynamo refuses the attribute the tap sets on its outputs."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except AttributeError:                      # traced without Dynamo (non-strict export, AOTAutograd alone)
        return False
    return tx is not None and not tx.output.is_root_tracer()


class _Handle:
    """Removes hooks registered here: `undo` takes them off the module, and their entries go. `grads`: the grads the
    hooks watch, `INPUT_GRADS` or `ALL_GRADS` (counted in `_grad_watchers` until removed); `gate`: their `active`
    (held in `_gates` until removed)."""

    def __init__(self, undo: Callable[[], None], *keys: tuple[int, int], grads: tuple[str, ...] = (),
                 gate: Optional[Callable[[], bool]] = None):
        self._undo, self._keys, self._grads, self._gate = undo, keys, grads, gate
        for where in grads:
            _grad_watchers[where] += 1
        if gate is not None:
            _gates[gate] = _gates.get(gate, 0) + 1

    def remove(self) -> None:
        if self._undo is None:
            return
        self._undo()
        self._undo = None
        for where in self._grads:
            _grad_watchers[where] -= 1
        if self._gate is not None:
            _gates[self._gate] -= 1
            if not _gates[self._gate]:
                del _gates[self._gate]
        for key in self._keys:
            _hooks.pop(key, None)
        if not _hooks:  # the monitor is gone: a later one says it again
            _said.clear()


def _entry(module: torch.nn.Module, key: str, hook: Callable, with_kwargs: bool, with_output: bool,
           active: Optional[Callable[[], bool]] = None) -> tuple[int, int]:
    """Enters `hook` as `module`'s trainmon hook `key`, which `trainmon::observe` runs (see the module doc) where
    `active()` (None: always) says it has something to do."""
    token = module.__dict__.get(_TOKEN)
    if token is None:
        token = torch.tensor(next(_tokens))
        object.__setattr__(module, _TOKEN, token)
        _no_longer_leaves(module)
    entry = (int(token), _kinds.setdefault(key, len(_kinds)))
    if entry in _hooks:
        raise RuntimeError(f"trainmon: a {key} hook is already on {type(module).__name__} (two monitors on one model)")
    _hooks[entry] = (weakref.ref(module), hook, with_kwargs, with_output, active)
    return entry


def _register(module: torch.nn.Module, kind: str, hook: Callable, with_kwargs: bool, with_output: bool,
              grads: tuple[str, ...], active: Optional[Callable[[], bool]], register: Callable) -> _Handle:
    key = _entry(module, kind, hook, with_kwargs, with_output, active)

    # Dynamo would compile the frames an eager hook calls, when the hook runs under a compiled module's call
    # (Dynamo's frame callback is set). Elsewhere the hook is called as it is: the wrapper that turns Dynamo off
    # costs more than some hooks.
    eager = torch._dynamo.disable(hook, recursive=True)
    gated = active is not None

    def traced_or_eager(mod, *args):
        if torch.compiler.is_compiling():  # returns the call's inputs (or output) with their grads tapped
            if _graph_idle and gated:
                return None
            call_args, call_kwargs = args[0], (args[1] if with_kwargs else {})
            traced = _observe_in_graph(mod, kind, call_args, call_kwargs, args[-1] if with_output else None,
                                       with_output)
            return traced if with_output or with_kwargs else traced[0]
        if stream_capturing():
            _say_once(CAPTURE_REFUSED)
            return None
        return (hook if _dynamo_frame_callback() is None else eager)(mod, *args)

    # The hooks of the compiled module itself are frames of their own, which Dynamo would compile too: they
    # run eagerly (the grads of the region's outputs are watched there). Hooks inlined into a traced frame
    # are traced all the same.
    torch._dynamo.eval_frame.skip_code(traced_or_eager.__code__)
    handle = _Handle(register(traced_or_eager).remove, key, grads=grads, gate=active)
    _forget_compiled(module)
    return handle


def _forget_compiled(module: torch.nn.Module) -> None:
    """Drops what Dynamo compiled for `module`'s forward. Dynamo does not guard on the hooks of the modules it
    inlines (`skip_nnmodule_hook_guards`): a graph compiled before trainmon was attached (a compiled model run
    once first) would keep running without them, every module inside it unrecorded. The next call compiles it
    again, hooks included."""
    code = getattr(type(module).forward, "__code__", None)
    reset_code = getattr(torch._dynamo, "reset_code", None)
    if code is not None and reset_code is not None:
        reset_code(code)


def forward_pre_hook(module: torch.nn.Module, kind: str, hook: Callable, with_kwargs: bool = False,
                     prepend: bool = False, grads: tuple[str, ...] = (),
                     active: Optional[Callable[[], bool]] = None) -> _Handle:
    """Registers `hook` as `module`'s forward pre-hook, traceable (see the module doc); `kind` names it among
    trainmon's hooks on that module. `grads`: the activation grads the hook watches, those of calls' inputs
    (`INPUT_GRADS`) or of their inputs and outputs (`ALL_GRADS`), which it takes from a compiled call through
    `graph_call`. `active()`: whether the hook has something to do in the running forward pass (None: always);
    where it has not, a compiled graph's op for it returns at once, hook not run. Under compile its return value
    (modified inputs) is not used."""
    return _register(module, f"{kind}.pre", hook, with_kwargs, False, grads, active,
                     lambda fn: module.register_forward_pre_hook(fn, with_kwargs=with_kwargs, prepend=prepend))


def forward_hook(module: torch.nn.Module, kind: str, hook: Callable, with_kwargs: bool = False,
                 grads: tuple[str, ...] = (), active: Optional[Callable[[], bool]] = None) -> _Handle:
    """Registers `hook` as `module`'s forward hook, traceable (see `forward_pre_hook`)."""
    return _register(module, f"{kind}.post", hook, with_kwargs, True, grads, active,
                     lambda fn: module.register_forward_hook(fn, with_kwargs=with_kwargs))


def around_forward(module: torch.nn.Module, kind: str, before: Callable, after: Callable,
                   grads: tuple[str, ...] = (), active: Optional[Callable[[], bool]] = None) -> _Handle:
    """Runs `before(module, args, kwargs)` and `after(module, args, kwargs, output)` around each call of `module`'s
    forward, as a forward pre-hook and a forward hook with kwargs would (`before` may return new (args, kwargs)),
    traceable as they are (see the module doc).

    One wrapper around the module's `forward` runs the befores and afters of all of trainmon's groups on it, in
    the order they were registered: torch's hook path costs more per call than the hooks trainmon runs on it
    (`Module._call_impl` then takes its slow path, and each hook adds a frame and its checks). The wrapper runs
    inside `Module.__call__`, after every forward pre-hook. Where the module holds forward hooks (which may
    replace the output after forward) or backward hooks (which wrap the inputs before it) when trainmon is
    attached, the two are registered as hooks instead, so that what those do is seen as before.

    `grads` and `active` as for `forward_pre_hook`: before and after share one `active` answer a call."""
    around = module.__dict__.get(_AROUND)
    if around is None and _hooks_outside_forward(module):
        pre = forward_pre_hook(module, kind, before, with_kwargs=True, grads=grads, active=active)
        post = forward_hook(module, kind, after, with_kwargs=True, grads=grads, active=active)
        return _Handle(lambda: (pre.remove(), post.remove()))
    if around is None:
        around = _Around(module)
    entry = around.add(kind, before, after, active)
    _forget_compiled(module)
    return _Handle(lambda: around.drop(entry), grads=grads, gate=active)


def after_forward(module: torch.nn.Module, kind: str, after: Callable,
                  active: Optional[Callable[[], bool]] = None) -> _Handle:
    """Runs `after(module, args, kwargs, output)` after each call of `module`'s forward: `around_forward` with
    nothing to do before it (one wrapper, and under compile one op a call, for every group on the module)."""
    return around_forward(module, kind, _nothing_before, after, active=active)


def before_forward(module: torch.nn.Module, kind: str, before: Callable,
                   active: Optional[Callable[[], bool]] = None) -> _Handle:
    """Runs `before(module, args, kwargs)` before each call of `module`'s forward: `around_forward` with nothing
    to do after it."""
    return around_forward(module, kind, before, _nothing_after, active=active)


def _nothing_before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    return None


def _nothing_after(module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
    return None


_AROUND = "_trainmon_around"  # the attribute that holds a module's `_Around`
# The attribute, True, of a module with an `_Around` that holds no other module with trainmon's hooks (a leaf of the
# hooked tree): its traced call is one op (`_observe_leaf_in_graph`). A module hooked later inside it unsets it.
_LEAF = "_trainmon_leaf"
_leaves: "weakref.WeakSet[_Around]" = weakref.WeakSet()  # the `_Around`s of the leaves that have submodules
# The attribute, True, of a module with an `_Around` whose every group has an `active`: its traced call puts no op
# in a graph traced while `_graph_idle`.
_GATED = "_trainmon_gated"


def _no_longer_leaves(hooked: torch.nn.Module) -> None:
    """Unsets `_LEAF` on the modules that hold `hooked`, a module given its first trainmon hook."""
    for around in list(_leaves):
        module = around.module()
        if module is not None and module is not hooked and any(inner is hooked for inner in module.modules()):
            module.__dict__.pop(_LEAF, None)
            _leaves.discard(around)


def _hooks_outside_forward(module: torch.nn.Module) -> bool:
    """Whether `module` holds hooks that act outside its `forward` on what it is called with or returns."""
    hooks = torch.nn.modules.module
    return bool(module._forward_hooks or module._backward_hooks or module._backward_pre_hooks
                or hooks._global_forward_hooks or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


class _Entry(NamedTuple):
    """One group's hooks on a module's forward, which `_Around` runs."""

    kind: str
    before: Callable
    after: Callable
    eager_before: Callable  # `before` and `after` with Dynamo off
    eager_after: Callable
    active: Optional[Callable[[], bool]]  # see `forward_pre_hook`


class _Around:
    """The wrapper `around_forward` puts in place of one module's forward, and the groups' entries it runs
    (`_Entry`).

    Under tracing the wrapper reads none of this (Dynamo would guard on it, and a model compiled block by block
    would compile once per block): it puts one `trainmon::observe` op before the forward and one after, whose
    eager hooks (`befores`, `afters`) run the entries; a leaf (`_LEAF`, a constant the graph guards by value) one op
    after it, which runs both; a module whose every group has an `active` (`_GATED`, the same) none while
    `_graph_idle`."""

    def __init__(self, module: torch.nn.Module):
        self.entries: list[_Entry] = []
        self.module = weakref.ref(module)
        self.replaced = module.__dict__.get("forward")  # an instance's own forward (accelerate sets one), or None
        self.keys = (_entry(module, "forward.pre", self.befores, True, False, self.active),
                     _entry(module, "forward.post", self.afters, True, True, self.active),
                     _entry(module, "forward.both", (self.befores, self.afters), True, True, self.active))
        if not any(_TOKEN in inner.__dict__ for inner in module.modules() if inner is not module):
            module.__dict__[_LEAF] = True
            if module._modules:  # it may hold a module hooked later
                _leaves.add(self)
        # The wrapper calls the class's forward function with the module it is bound to; anything else as the
        # module would have called it.
        plain = self.replaced is None and isinstance(type(module).forward, types.FunctionType)
        self.wrapper = wrapper = _wrapper(self, None if plain else module.forward)
        try:  # what reads the forward's parameters (transformers' Trainer picks its dataset columns by them) reads them
            signature = inspect.signature(module.forward)
            wrapper.__signature__ = signature.replace(parameters=[
                inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY), *signature.parameters.values()])
        except (TypeError, ValueError):
            pass
        object.__setattr__(module, _AROUND, self)
        # A method of the module, so that a deep copy of the module (an EMA copy) runs its own forward.
        module.__dict__["forward"] = types.MethodType(wrapper, module)

    def add(self, kind: str, before: Callable, after: Callable, active: Optional[Callable[[], bool]]) -> _Entry:
        if any(entry.kind == kind for entry in self.entries):
            raise RuntimeError(f"trainmon: a {kind} hook is already on {type(self.module()).__name__} "
                               "(two monitors on one model)")
        entry = _Entry(kind, before, after, torch._dynamo.disable(before, recursive=True),
                       torch._dynamo.disable(after, recursive=True), active)
        self.entries.append(entry)
        self._mark_gated()
        return entry

    def _mark_gated(self) -> None:
        module = self.module()
        if module is not None:
            module.__dict__[_GATED] = all(entry.active is not None for entry in self.entries)

    def active(self) -> bool:
        """Whether some group has something to do in the running forward pass (see `forward_pre_hook`)."""
        return bool(self.running())

    def running(self) -> list[_Entry]:
        """The entries with something to do in the running forward pass: most often all of them, or none in a step
        that is not collected, whose hooked calls then cost the wrapper alone (a group's before and after for
        nothing cost it about five microseconds a call)."""
        running = self.entries
        for entry in self.entries:
            if entry.active is not None and not entry.active():
                running = [other for other in running if other is not entry]
        return running

    def befores(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        for entry in self.entries:
            entry.before(module, args, kwargs)

    def afters(self, module: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
        for entry in self.entries:
            entry.after(module, args, kwargs, output)

    def drop(self, entry: _Entry) -> None:
        """Removes one group's entry; the module gets its forward back with the last, unless something replaced
        the wrapper since (it then runs the forward alone)."""
        if entry in self.entries:
            self.entries.remove(entry)
        module = self.module()
        if self.entries or module is None:
            self._mark_gated()
            return
        for key in self.keys:
            _hooks.pop(key, None)
        module.__dict__.pop(_AROUND, None)
        module.__dict__.pop(_LEAF, None)
        module.__dict__.pop(_GATED, None)
        _leaves.discard(self)
        if getattr(module.__dict__.get("forward"), "__func__", None) is self.wrapper:
            if self.replaced is None:
                del module.__dict__["forward"]
            else:
                module.__dict__["forward"] = self.replaced


def _wrapper(around: _Around, inner: Optional[Callable]) -> Callable:
    """The forward of a wrapped module: `inner` (a forward bound to it), or its class's `forward` function."""

    def forward(mod, *args, **kwargs):
        if torch.compiler.is_compiling():
            if _graph_idle and getattr(mod, _GATED, False):
                return _forward(mod, inner, args, kwargs)
            if getattr(mod, _LEAF, False):
                return _observe_leaf_in_graph(
                    mod, inner if inner is not None else functools.partial(type(mod).forward, mod), args, kwargs)
            # the call's inputs and output with their grads tapped
            args, kwargs = _observe_in_graph(mod, "forward.pre", args, kwargs)
            output = _forward(mod, inner, args, kwargs)
            return _observe_in_graph(mod, "forward.post", args, kwargs, output, with_output=True)
        if _dynamo_frame_callback() is not None:
            return _compiled_forward(around, inner, mod, args, kwargs)
        entries = around.running()
        if not entries:  # every call of a step that is not collected
            return inner(*args, **kwargs) if inner is not None else type(mod).forward(mod, *args, **kwargs)
        return _run_around(entries, True, mod, inner, args, kwargs)

    # As `traced_or_eager` in `_register`: the compiled module's own wrapper runs eagerly, and its forward is the
    # frame Dynamo compiles; a wrapper inlined into a traced frame is traced.
    torch._dynamo.eval_frame.skip_code(forward.__code__)
    return forward


def _forward(mod: torch.nn.Module, inner: Optional[Callable], args: tuple, kwargs: dict):
    """The forward a wrapper runs: `inner` (a forward bound to `mod`), or `mod`'s class's `forward` function."""
    return inner(*args, **kwargs) if inner is not None else type(mod).forward(mod, *args, **kwargs)


# Called by a compiled module's wrapper, `_forward` would be the frame Dynamo compiles; the module's forward is.
torch._dynamo.eval_frame.skip_code(_forward.__code__)


def _compiled_forward(around: _Around, inner: Optional[Callable], mod: torch.nn.Module, args: tuple, kwargs: dict):
    """A wrapped module's call under a compiled module's call (Dynamo's frame callback is set): its forward is the
    frame Dynamo compiles, and its hooks run with Dynamo off (see `_register`), as does the question of which have
    something to do. Where no hook's `active` answers True, the forward runs with `_graph_idle` set."""
    global _graph_idle
    entries, idle = _running_and_idle(around)
    outer, _graph_idle = _graph_idle, idle
    try:
        return _run_around(entries, False, mod, inner, args, kwargs)
    finally:
        _graph_idle = outer


def _run_around(entries: list[_Entry], eager: bool, mod: torch.nn.Module, inner: Optional[Callable], args: tuple,
                kwargs: dict):
    """The forward with the befores and afters of `entries` around it: as they are where `eager`, else with Dynamo
    off (see `_register`); none while a graph is being captured."""
    if entries and stream_capturing():
        _say_once(CAPTURE_REFUSED)
        entries = ()
    for entry in entries:
        changed = (entry.before if eager else entry.eager_before)(mod, args, kwargs)
        if changed is not None:
            args, kwargs = changed
    output = _forward(mod, inner, args, kwargs)
    for entry in entries:
        (entry.after if eager else entry.eager_after)(mod, args, kwargs, output)
    return output


@torch._dynamo.disable(recursive=True)
def _running_and_idle(around: _Around) -> tuple[list[_Entry], bool]:
    """(the entries of `around` with something to do, whether no registered hook's `active` answers True)."""
    return around.running(), not any(gate() for gate in _gates)


torch._dynamo.eval_frame.skip_code(_compiled_forward.__code__)
torch._dynamo.eval_frame.skip_code(_run_around.__code__)


def named_modules(chunk: torch.nn.Module):
    """`chunk.named_modules()` without torch.compile's wrappers (each would be a second name for the module it
    wraps, whose hooks already see every call)."""
    from torch._dynamo.eval_frame import OptimizedModule

    for name, module in chunk.named_modules():
        if not isinstance(module, OptimizedModule):
            yield compiled_name(name), module
