"""watch_grad sees the grad that Tensor.register_hook sees, per output of a multi-output node."""
import torch

from trainmon.hooks.grad_watch import watch_grad


def test_each_output_of_a_split_gets_its_own_grad_as_a_tensor_hook_sees_it():
    x = torch.randn(6, 4, requires_grad=True)
    parts = (x * 3).split(2)  # one autograd node, three outputs
    watched, hooked = {}, {}
    for i, part in enumerate(parts):
        watch_grad(part, lambda g, i=i: watched.__setitem__(i, g.clone()))
        part.register_hook(lambda g, i=i: hooked.__setitem__(i, None if g is None else g.clone()))
    (parts[0].sum() * 2 + (parts[2] ** 2).sum()).backward()
    assert hooked[1] is None  # a tensor hook is called with None where no grad reached the output
    assert sorted(watched) == [0, 2]  # watch_grad is not called there
    for i in watched:
        torch.testing.assert_close(watched[i], hooked[i], rtol=0, atol=0)
    torch.testing.assert_close(watched[2], 2 * parts[2].detach(), rtol=0, atol=0)


def test_the_grad_is_the_sum_over_consumers_and_the_hook_dies_with_the_graph():
    x = torch.randn(5, requires_grad=True)
    y = x.exp()
    seen = []
    watch_grad(y, seen.append)
    (y * 2 + y.sin()).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], 2 + y.detach().cos())
    y = x.exp()  # a new graph: the old node's hook is not carried over
    y.sum().backward()
    assert len(seen) == 1
