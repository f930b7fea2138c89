"""Forward hooks and grad taps on modules: activations (`actv`) and grads with respect to them (`actv_grad`).

Activation grads come from two light autograd attachments instead of torch's full backward hooks, whose
identity views around module outputs break frameworks that modify outputs in place (Megatron's fused
bias-dropout-add) and cost time even when idle:

- the grad of each output: a pre-hook on its `grad_fn` (`grad_watch`; the output stays the module's own tensor);
- the grad of each input (tensor positional arguments and activations passed by keyword, `input_places`):
  the forward pre-hook passes the inputs through one identity autograd node (`_InputTap`) whose backward
  sees the grads the module's backward computed for them, before they are summed with grads from other
  consumers of the same tensors;
- except where a module's one input is taken by one autograd node of its own (most leaf modules: an
  activation function, a norm, a linear layer): that node's post-hook sees the same grad, without the tap's
  two nodes. A module's first recorded call is tapped, and learns whether its graph has that shape
  (`grad_watch.sole_consumer`) and leaves the input as it was; later calls check both on their own.

These are the `grad_output` and `grad_input` a full backward hook would see (it covers positional
arguments only). The tap hands the module aliases of its inputs (sharing storage and version counter)
rather than autograd views, so a module that modifies its inputs in place (Megatron's masked softmax)
runs as it does unmonitored. Inside a `torch.compile`d region, where neither attachment can run, the compiled
graph hands the same grads to the hooks, in the same order (`in_graph.graph_call`).

A call's input records take their place in the call order when the call starts (its forward pre-hook),
before anything the module runs: a NaN that came in with the batch is then first at the model's input.
Only training forwards are recorded (see `forward_passes`); evaluation forwards go to `actv_eval` when
the state has an evaluation collector. Grad hooks go only on tensors made in this forward (never on
Parameters a module returns, such as Megatron's biases, or other leaves that outlive the step).
"""
from __future__ import annotations

import collections
import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import torch

from trainmon.hooks.hook_group import Hooks
from trainmon.hooks import in_graph
from trainmon.hooks.collector import StepCollector
from trainmon.hooks.in_graph import in_backward
from trainmon.hooks.grad_watch import NO_CONSUMER, NodeGrads, OutputGrad, sole_consumer
from trainmon.core.records import ACTV, ACTV_EVAL, ACTV_GRAD, record_key
from trainmon.hooks.state import HookState
from trainmon.hooks.tensor_select import TAP_ROOT, floating_leaves, input_places, input_values, values_at

logger = logging.getLogger("trainmon")


class CallNames(NamedTuple):
    """The names of one call of a module in a forward pass, and of its leaves: made once per module and call
    position, and the same string objects every step (their hashes, taken by every record's key, are kept)."""

    call: str  # the module's name; "<name>#k" for its k-th call after the first in one forward pass
    output: str  # "<call>.output"
    input: str  # "<call>.input"


@dataclass
class WatchedModule:
    """A module whose activations are recorded, with its `targets` entry (tuple selectors)."""

    name: str
    module: torch.nn.Module
    vpp_stage: int
    input_sel: Optional[object] = None
    output_sel: Optional[object] = None
    input_grad_sel: Optional[object] = None
    output_grad_sel: Optional[object] = None
    calls_in_micro: tuple = (None, 0)  # (which forward pass, number of calls of the module seen in it)
    # (step, micro_step, CallNames) of calls run without grad, whose grads come when activation
    # checkpointing runs them again inside backward.
    unrecomputed: collections.deque = field(default_factory=collections.deque)
    call_names: list = field(default_factory=list)  # CallNames of its first, second, ... call in a forward pass
    # Calls whose forward has started and not returned (a stack: calls may nest); None where not recorded. All of
    # one forward pass of the model, `open_pass` (`HookState.forward_passes`).
    open_calls: list = field(default_factory=list)
    open_pass: int = -1
    grad_recorders: tuple = ()  # (the tap's grads, an output's grad, a node's grads) callbacks, guarded
    # where -> the hook on an output's grad_fn, or on the node that takes the input: made once, as every step's
    # calls repeat them (hooks that live until backward would otherwise be garbage for Python's collector)
    output_grad_hooks: dict = field(default_factory=dict)
    graph_grad_recorders: dict = field(default_factory=dict)  # (micro, leaf names) -> `_leaf_grads_recorder`'s
    # Whether the module's input grad is read at the one node that takes its input, untapped: None until its
    # first tapped call shows whether its graph has that shape.
    untapped: Optional[bool] = None


@dataclass(slots=True)
class _Call:
    """One recorded module call, from its forward pre-hook on: where its records go in the call order, and where
    its input grads are recorded (their `suffixes` set when its inputs are tapped, `names` when its forward
    returns)."""

    watched: WatchedModule
    input_index: int  # call index of its input records, taken when the call started
    micro: int  # its forward pass of the step: the training micro-step, or the evaluation pass
    suffixes: tuple = ()  # leaf-name suffix per tapped input ("" or "_<i>")
    tapped_places: tuple = ()  # input_places of the tapped inputs
    # (tapped input's position, output leaf name) of outputs that are the tap's own aliases (a module returning
    # its input: Megatron's IdentityOp, dropout with p = 0): their grad is the one the tap sees
    output_grads: tuple = ()
    names: Optional[CallNames] = None
    source: Optional[tuple] = None  # (grad_fn, output_nr, tensor, version) of its input, where it is not tapped

    def __call__(self, grads) -> None:
        """Hands the grads of its tapped inputs (and of outputs that are those inputs) to its recorder: the call is
        its own callback, one object less a call for Python's garbage collector to count until the backward."""
        self.watched.grad_recorders[0](self, grads)


class _InputTap(torch.autograd.Function):
    """Identity on a module call's inputs; its backward hands their grads to the call's input grad recorder."""

    @staticmethod
    def forward(ctx, call: _Call, *tensors):
        ctx.call = call
        # Views of the inputs would make autograd reject in-place ops on them; detached aliases do not.
        if len(tensors) == 1:
            return (tensors[0].detach(),)
        return tuple([t.detach() for t in tensors])

    @staticmethod
    def backward(ctx, *grads):
        ctx.call(grads)
        return (None,) + grads


# `Function.apply` is a Python wrapper around the C++ apply for functorch's transforms (vmap, grad, ...). Outside
# them it only adds four Python frames to every tap, and unwraps dead functorch wrappers, which no module input is.
_apply_tap_directly = super(torch.autograd.Function, _InputTap).apply


def _apply_tap(call: _Call, tensors: list) -> tuple:
    if torch._C._are_functorch_transforms_active():
        return _InputTap.apply(call, *tensors)
    return _apply_tap_directly(call, *tensors)


def _tapped_inputs(inputs: list, selector, requires_grad=None) -> tuple[list[int], tuple[str, ...]]:
    """The positions in `inputs` of the selected floating tensors that require grad (a tensor passed twice:
    once), and their leaf-name suffixes ("" or "_<i>"). `requires_grad(tensor)` tells, where the tensors' own
    flag does not (a compiled graph's buffers)."""
    if len(inputs) == 1 and selector is None:     # most calls: one tensor, named `input`
        t = inputs[0]
        grad = t.requires_grad if requires_grad is None else requires_grad(t)
        return ([0], ("",)) if grad and t.is_floating_point() else ([], ())
    suffixes = {id(t): suffix for suffix, t in floating_leaves(inputs, selector)}
    tapped, seen = [], set()
    for i, t in enumerate(inputs):
        if id(t) in suffixes and id(t) not in seen and (t.requires_grad if requires_grad is None else requires_grad(t)):
            tapped.append(i)
            seen.add(id(t))
    return tapped, tuple(suffixes[id(inputs[i])] for i in tapped)


class ActivationHooks(Hooks):
    """Registers forward hooks (and, for activation grads, forward pre-hooks) on the watched modules."""

    collects = "activations (actv, actv_grad)"

    def __init__(self, state: HookState, modules: list[WatchedModule], forward: bool, backward: bool):
        self.state = state
        self.modules = modules
        self.forward = forward
        self.backward = backward
        self._handles: list = []

    def install(self) -> None:
        for watched in self.modules:
            item = f"activations of {watched.name or '<root>'}"
            if self.backward:
                # Built once per module: the autograd callbacks of every call share them.
                watched.grad_recorders = (self.state.guarded(item, self._record_tap_grads),
                                          self.state.guarded(item, self._record_grad),
                                          self.state.guarded(item, self._record_node_grads))
                watched.output_grad_hooks.clear()
                watched.graph_grad_recorders.clear()
            self._handles.append(in_graph.around_forward(
                watched.module, "activations", self.state.guarded(item, self._make_pre_forward(watched)),
                self.state.guarded(item, self._make_forward(watched)),
                grads=in_graph.ALL_GRADS if self.backward else (), active=self._recording))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for watched in self.modules:
            watched.open_calls.clear()
            watched.unrecomputed.clear()
            watched.output_grad_hooks.clear()
            watched.graph_grad_recorders.clear()

    @staticmethod
    def _call_names(watched: WatchedModule, forward_pass: tuple) -> CallNames:
        last_pass, calls = watched.calls_in_micro
        calls = calls + 1 if last_pass == forward_pass else 1
        watched.calls_in_micro = (forward_pass, calls)
        names = watched.call_names
        while len(names) < calls:  # a module called several times in one forward pass gets one record per call
            call = watched.name if not names else f"{watched.name}#{len(names)}"
            names.append(CallNames(call, f"{call}.output", f"{call}.input"))
        return names[calls - 1]

    def _target(self) -> Optional[StepCollector]:
        """The collector of the running forward pass: the step's for training where that step is collected, the
        evaluation one otherwise (set where the last step applied was collected), None when nothing is recorded."""
        state = self.state
        if state.training_forward:
            return state.collector if state.collecting else None
        return state.eval_collector

    def _recording(self) -> bool:
        """Whether the running forward pass is recorded: where it is not, the wrapper of a module's forward, or a
        compiled graph, skips these hooks."""
        return self._target() is not None

    def _make_pre_forward(self, watched: WatchedModule):
        state = self.state

        def pre_hook(module, args, kwargs):
            # One entry per call, popped by its forward hook: None where this call is not recorded. Those left by
            # an earlier forward pass are of calls that raised (an out-of-memory error the loop caught and went
            # on): dropped, with the input and the graph behind it that they hold.
            if watched.open_pass != state.forward_passes:
                watched.open_calls.clear()
                watched.open_pass = state.forward_passes
            collector = self._target()
            if collector is None:
                watched.open_calls.append(None)
                return None
            training = state.training_forward
            call = _Call(watched, collector.next_call_index(),
                         (state.forward_micro if training else state.eval_pass)(watched.vpp_stage))
            watched.open_calls.append(call)
            if self.backward and training and torch.is_grad_enabled():
                graph = in_graph.graph_call()
                if graph is not None:
                    self._watch_graph_inputs(call, graph, args, kwargs)
                    return None
                return self._tap_inputs(call, args, kwargs)
            return None

        return pre_hook

    @staticmethod
    def _tap_inputs(call: _Call, args: tuple, kwargs: dict) -> Optional[tuple]:
        """(args, kwargs) with the selected floating inputs that require grad passed through one `_InputTap`."""
        places = input_places(args, kwargs)
        inputs = values_at(places, args, kwargs)
        tapped, call.suffixes = _tapped_inputs(inputs, call.watched.input_grad_sel)
        if not tapped:
            return None
        if call.watched.untapped and len(tapped) == 1:
            source = inputs[tapped[0]]
            node = source.grad_fn
            if node is not None and not in_backward():  # (activation checkpointing's runs are tapped)
                call.source = (node, source.output_nr, source, source._version)
                return None
        call.tapped_places = tuple([places[i] for i in tapped])
        aliases = _apply_tap(call, [inputs[i] for i in tapped])
        args, kwargs = list(args), dict(kwargs)
        for i, alias in zip(tapped, aliases):
            setattr(alias, TAP_ROOT, getattr(inputs[i], TAP_ROOT, inputs[i]))
            positional, key = places[i]
            (args if positional else kwargs)[key] = alias
        return tuple(args), kwargs

    @staticmethod
    def _watch_graph_inputs(call: _Call, graph: in_graph.GraphCall, args: tuple, kwargs: dict) -> None:
        """Asks the compiled graph running the call for the grads of its selected inputs, for the call's tap
        recorder (as `_tap_inputs` does in eager mode)."""
        inputs = input_values(args, kwargs)
        tapped, call.suffixes = _tapped_inputs(inputs, call.watched.input_grad_sel, graph.takes_grad)
        if tapped:
            graph.on_grads([inputs[i] for i in tapped], call)

    def _make_forward(self, watched: WatchedModule):
        state = self.state

        def forward_hook(module, args, kwargs, output):
            call = watched.open_calls.pop() if watched.open_calls else None
            if call is None:
                return
            if in_backward():  # activation checkpointing runs the forward again
                self._hook_recomputed(watched, call, output)
                return  # its activations were recorded when it first ran
            training, micro = state.training_forward, call.micro
            collector = state.collector if training else state.eval_collector
            names = self._call_names(watched, (collector.step, training, micro))
            prefix = names.output
            # Records and grad taps select the same leaves unless their `targets` selectors differ.
            output_leaves = floating_leaves(output, watched.output_sel, prefix) if self.forward else None
            if training and self.backward and torch.is_grad_enabled():
                call.names = names
                shared = output_leaves is not None and watched.output_grad_sel == watched.output_sel
                grad_leaves = output_leaves if shared else floating_leaves(output, watched.output_grad_sel, prefix)
                graph = in_graph.graph_call()
                if graph is not None:
                    self._watch_graph_outputs(watched, micro, graph, grad_leaves)
                else:
                    if call.source is not None:
                        self._hook_input_node(watched, call, micro, grad_leaves)
                    elif call.tapped_places:
                        aliases = values_at(call.tapped_places, args, kwargs)
                        grad_leaves, call.output_grads = _split_tapped_outputs(grad_leaves, aliases)
                        if watched.untapped is None:
                            watched.untapped = _readable_untapped(watched, call, aliases, grad_leaves)
                    self._hook_output_grads(watched, micro, grad_leaves)
            elif training and self.backward:
                watched.unrecomputed.append((collector.step, micro, names))
            if self.forward:
                inputs = input_values(args, kwargs)
                for i, t in enumerate(inputs):
                    inputs[i] = getattr(t, TAP_ROOT, t)
                self._record_activations(collector, ACTV if training else ACTV_EVAL, watched, names.input, micro,
                                         call.input_index, inputs, output_leaves)

        return forward_hook

    @staticmethod
    def _watch_graph_outputs(watched: WatchedModule, micro: int, graph: in_graph.GraphCall,
                             output_leaves: list) -> None:
        """Asks the compiled graph running a call for the grads of its output leaves, for the output-grad recorder."""
        leaves = [(leaf_name, t) for leaf_name, t in output_leaves if graph.takes_grad(t)]
        if leaves:
            graph.on_grads([t for _, t in leaves], _leaf_grads_recorder(watched, micro, tuple([n for n, _ in leaves])))

    def _hook_recomputed(self, watched: WatchedModule, call: _Call, output) -> None:
        """Grad hooks on a call run again by activation checkpointing, named as when it first ran.

        A first run without grad (reentrant checkpointing) left its call in `unrecomputed`: the grads
        come through this run's graph. A first run with grad (non-reentrant) is hooked already, and
        this run's graph only feeds the saved tensors of that one.
        """
        step = self.state.collector.step
        while watched.unrecomputed:
            first_step, micro, names = watched.unrecomputed.popleft()
            if first_step == step:
                break
        else:
            return
        call.names, call.micro = names, micro  # its input grads, if tapped, are recorded under the first run's name
        self._hook_output_grads(watched, micro, floating_leaves(output, watched.output_grad_sel, names.output))

    def _hook_input_node(self, watched: WatchedModule, call: _Call, micro: int, grad_leaves: list) -> None:
        """Hooks the node that takes an untapped call's input, for its input grad (its output grads are hooked as
        a tapped call's are: a node's post-hook would record them after the pre-hooks of enclosing modules that
        return the same tensor, where a tapped call's are recorded before).
        A call whose graph has not the shape its module's first call had (or that modified its input in place, which
        its first call did not) cannot tell its input's grad from what other consumers add to it: it is not
        recorded, said once, counted in run.json, and the module's later calls are tapped."""
        (node, output_nr, tensor, version), call.source = call.source, None
        input_leaf = call.names.input + call.suffixes[0]
        # An input modified in place has a new node; where it is a view, its old node has left the graph.
        taking = _taking_node(grad_leaves, node, output_nr) if tensor._version == version else None
        if taking is NO_CONSUMER:  # no grad reaches the input from this call
            return
        if taking is None:
            watched.untapped = False
            missing = self.state.collector.input_grads_not_recorded
            if input_leaf not in missing:
                logger.warning("trainmon: the grad of %s at step %s is not recorded: that call's autograd graph "
                               "differs from its module's first call's, or the call modified its input in place, so "
                               "its grad cannot be told apart from other grads of the same tensor (counted in "
                               "run.json); its later calls are tapped", input_leaf, self.state.collector.step)
            missing[input_leaf] = missing.get(input_leaf, 0) + 1
            return
        node, index = taking
        where = (micro, input_leaf, index)
        hook = watched.output_grad_hooks.get(where)
        if hook is None:
            hook = watched.output_grad_hooks[where] = NodeGrads(
                functools.partial(watched.grad_recorders[2], watched, micro, input_leaf), index, None)
        node.register_hook(hook)

    @staticmethod
    def _hook_output_grads(watched: WatchedModule, micro: int, output_leaves: list) -> None:
        hooks = watched.output_grad_hooks
        for leaf_name, tensor in output_leaves:
            grad_fn = tensor.grad_fn
            if grad_fn is not None:  # made in this forward: the hook goes with its graph
                graph = in_graph.graph_output_call(tensor, grad_fn)
                if graph is not None:  # its grad comes with a tapped call's inside a compiled region
                    graph.on_grads([tensor], _leaf_grads_recorder(watched, micro, (leaf_name,)))
                    continue
                where = (micro, leaf_name, tensor.output_nr)
                hook = hooks.get(where)
                if hook is None:
                    hook = hooks[where] = OutputGrad(
                        functools.partial(watched.grad_recorders[1], watched, micro, leaf_name), tensor.output_nr)
                grad_fn.register_prehook(hook)

    def _record_grad(self, watched: WatchedModule, micro: int, leaf_name: str, grad: torch.Tensor) -> None:
        """Records one grad under `leaf_name`: as `_record_grads` does, for the one grad a node hook is handed."""
        if not self.state.collecting:
            return
        collector, vpp = self.state.collector, watched.vpp_stage
        index = collector.call_index_of(ACTV_GRAD, leaf_name, vpp, micro, grad)
        collector.record_one(record_key(ACTV_GRAD, leaf_name, vpp, micro, index, grad.shape, grad.dtype), grad)

    def _record_node_grads(self, watched: WatchedModule, micro: int, input_leaf: str,
                           input_grad: Optional[torch.Tensor], output_grad: None) -> None:
        """The input grad a node's post-hook sees (its `NodeGrads` is made without an output: `output_grad` is None)."""
        if input_grad is not None:
            self._record_grad(watched, micro, input_leaf, input_grad)

    def _record_tap_grads(self, call: _Call, grads) -> None:
        """The grads a call's tap sees: of its inputs, and of its outputs that are those inputs (first: their
        node pre-hook would have run before the tap's backward). Where some of them got a grad, autograd hands the
        others as zeros: an input's zero grad is what a full backward hook reports too; an output that is an input
        and reached nothing is recorded with that zero grad, where a full backward hook reports none."""
        if call.names is None:
            return
        named = []
        for i, leaf_name in call.output_grads:
            if grads[i] is not None:
                named.append((leaf_name, grads[i]))
        for suffix, grad in zip(call.suffixes, grads):
            if grad is not None:
                named.append((call.names.input + suffix, grad))
        self._record_grads(call.watched, call.micro, named)

    def _record_grads(self, watched: WatchedModule, micro: int, named_grads: list) -> None:
        if not self.state.collecting or not named_grads:
            return
        collector, vpp = self.state.collector, watched.vpp_stage
        keys, grads = [], []
        for leaf_name, grad in named_grads:
            index = collector.call_index_of(ACTV_GRAD, leaf_name, vpp, micro, grad)
            keys.append(record_key(ACTV_GRAD, leaf_name, vpp, micro, index, grad.shape, grad.dtype))
            grads.append(grad)
        collector.record(keys, grads, defer=True)

    def _record_activations(self, collector: StepCollector, family: str, watched: WatchedModule, input_prefix: str,
                            micro: int, input_index: int, inputs: list, output_leaves: list) -> None:
        input_leaves = floating_leaves(inputs, watched.input_sel, input_prefix)
        if not (input_leaves or output_leaves):
            return
        vpp = watched.vpp_stage
        keys, tensors = [], []
        for leaf_name, t in input_leaves:
            keys.append(record_key(family, leaf_name, vpp, micro, input_index, t.shape, t.dtype))
            tensors.append(t)
        for leaf_name, t in output_leaves:
            index = collector.call_index_of(family, leaf_name, vpp, micro, t)
            keys.append(record_key(family, leaf_name, vpp, micro, index, t.shape, t.dtype))
            tensors.append(getattr(t, TAP_ROOT, t))  # an input returned as it came: the input's record serves
        collector.record(keys, tensors, defer=True)


def _leaf_grads_recorder(watched: WatchedModule, micro: int, leaf_names: tuple) -> Callable[[list], None]:
    """What records the grads a compiled graph hands back of a call's output leaves `leaf_names`: made once per
    module, micro-step and leaves, as `output_grad_hooks` are."""
    where = (micro, leaf_names)
    recorder = watched.graph_grad_recorders.get(where)
    if recorder is None:
        recorder = watched.graph_grad_recorders[where] = functools.partial(
            _record_leaf_grads, watched.grad_recorders[1], watched, micro, leaf_names)
    return recorder


def _record_leaf_grads(record_grad, watched: WatchedModule, micro: int, leaf_names: tuple, grads: list) -> None:
    """Records, with `record_grad`, the grads that arrived of a call's output leaves `leaf_names`."""
    for leaf_name, grad in zip(leaf_names, grads):
        if grad is not None:
            record_grad(watched, micro, leaf_name, grad)


def _readable_untapped(watched: WatchedModule, call: _Call, aliases: list, grad_leaves: list) -> bool:
    """Whether a tapped call shows that its module's later calls can be read untapped: its one tapped input is taken
    by one node behind its one output, which is not that input, and no selector hides outputs grads may come from.
    Not where the module modified its input in place (the tap's node is then no longer the input's): untapped, an
    in-place op on an input that is a view (Megatron's masked softmax on its attention scores) takes the input's
    node out of the graph."""
    if len(aliases) != 1 or call.output_grads or watched.output_grad_sel is not None:
        return False
    tap = aliases[0].grad_fn
    return type(tap) is _InputTap._backward_cls and \
        _taking_node(grad_leaves, tap, aliases[0].output_nr) not in (None, NO_CONSUMER)


def _taking_node(grad_leaves: list, source, source_nr: int) -> Optional[tuple]:
    """(node, input edge) where one autograd node of a call takes its input (output `source_nr` of node `source`)
    and lies behind the one output the call made; NO_CONSUMER where no grad can reach the input from that output;
    None otherwise. Outputs without a graph (Parameters, constants) are left aside."""
    made = grad_leaves if len(grad_leaves) == 1 else [leaf for leaf in grad_leaves if leaf[1].grad_fn is not None]
    if len(made) > 1:
        return None
    start = made[0][1].grad_fn if made else None
    if start is None:
        return NO_CONSUMER
    if start is source:
        return None
    return sole_consumer(start, source, source_nr)


def _split_tapped_outputs(output_leaves: list, aliases: list) -> tuple[list, tuple]:
    """(the output leaves that are none of a call's tapped inputs, (position in `aliases`, leaf name) of those
    that are), `aliases` being the tapped inputs as the module got them. The tap records the latter's grads."""
    rest, by_tap = [], []
    for leaf_name, tensor in output_leaves:
        for position, alias in enumerate(aliases):
            if alias is tensor:
                by_tap.append((position, leaf_name))
                break
        else:
            rest.append((leaf_name, tensor))
    return rest, tuple(by_tap)
