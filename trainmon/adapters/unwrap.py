"""The object whose `step()` runs once per applied update, found under training loops' optimizer wrappers.

accelerate's `AcceleratedOptimizer` (also what transformers' `Trainer` hands its callbacks) runs its `step()`
on every micro-batch and skips the inner step while gradients accumulate; Lightning's `LightningOptimizer`
hands the inner optimizer and the closure to its strategy, which calls the inner `step(closure)`. Their
inner optimizer's `step()` is the one that runs once per update.
"""
from __future__ import annotations

# (module prefix of the wrapper's class, attribute holding the wrapped optimizer)
_WRAPPERS = (("accelerate.", "optimizer"), ("lightning.", "_optimizer"), ("pytorch_lightning.", "_optimizer"))


def unwrap_optimizer(optimizer) -> tuple[object, list[str]]:
    """(the innermost optimizer, the class names of the wrappers taken off, outermost first)."""
    wrappers = []
    while True:
        module = type(optimizer).__module__
        attribute = next((attr for prefix, attr in _WRAPPERS if module.startswith(prefix)), None)
        inner = getattr(optimizer, attribute, None) if attribute else None
        if inner is None or inner is optimizer:
            return optimizer, wrappers
        wrappers.append(type(optimizer).__name__)
        optimizer = inner
