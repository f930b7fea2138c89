"""collective_bindings: every place that holds a wrapped torch.distributed function is re-pointed, and put back only
where it still holds the wrapper."""
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainmon.hooks.collective_bindings import repoint, restore


def test_every_binding_is_repointed_and_restored():
    original = dist.all_reduce

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    rebound = repoint({"all_reduce": (original, wrapper)})
    try:
        assert dist.all_reduce is wrapper and c10d.all_reduce is wrapper
        assert {(entry.holder, entry.attribute) for entry in rebound} == {(dist, "all_reduce"), (c10d, "all_reduce")}
    finally:
        restore(rebound)
    assert dist.all_reduce is original and c10d.all_reduce is original


def test_a_binding_changed_since_is_left_as_it_is():
    """A framework that binds its own function while monitoring (Megatron's fp32-accumulating reduce-scatter) keeps
    it after restore."""
    original = dist.reduce_scatter_tensor

    def wrapper(*args, **kwargs):
        return original(*args, **kwargs)

    def chosen_since(*args, **kwargs):
        return None

    rebound = repoint({"reduce_scatter_tensor": (original, wrapper)})
    c10d.reduce_scatter_tensor = chosen_since
    try:
        restore(rebound)
        assert dist.reduce_scatter_tensor is original and c10d.reduce_scatter_tensor is chosen_since
    finally:
        c10d.reduce_scatter_tensor = original


def test_a_binding_of_another_function_is_not_repointed():
    original = dist.broadcast
    c10d.broadcast = other = lambda *args, **kwargs: None
    try:
        rebound = repoint({"broadcast": (original, lambda *args, **kwargs: None)})
        assert c10d.broadcast is other and [(e.holder, e.attribute) for e in rebound] == [(dist, "broadcast")]
        restore(rebound)
    finally:
        c10d.broadcast = original
    assert dist.broadcast is original
