"""The NaN sentinel: no host sync in its hooks, one host transfer per step, numerics untouched, buffer growth."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from test_anomaly_online import SENTINEL_ONLY
from op_log import Ops
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.hooks import collector, sentinel


def sentinel_run(write_config, steps, counter=None, grad_acc_steps=2, **config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**{**SENTINEL_ONLY, **config}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=grad_acc_steps)
    if counter is None:
        losses = run_steps(model, optimizer, steps, grad_acc_steps)
    else:
        with counter:
            losses = run_steps(model, optimizer, steps, grad_acc_steps)
    monitor.stop()
    return monitor, losses


def test_losses_bit_identical_with_the_sentinel(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain = run_steps(model, optimizer, 4, grad_acc_steps=2)
    _, watched = sentinel_run(write_config, 4)
    assert watched == plain


def test_no_host_sync_and_one_transfer_per_step(output_dir, write_config, monkeypatch):
    transfers = []
    real_to_host = collector._to_host
    monkeypatch.setattr(collector, "_to_host", lambda flat: transfers.append(flat.numel()) or real_to_host(flat))
    plain = Ops()
    with plain:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_steps(model, optimizer, 3, grad_acc_steps=2)
    watched = Ops()
    sentinel_run(write_config, 3, counter=watched)
    assert len(transfers) == 3
    # loss.item() in the loop is the only sync, with or without the sentinel
    assert watched.counts.get("aten._local_scalar_dense", 0) == plain.counts.get("aten._local_scalar_dense", 0)
    assert watched.counts.get("to another device", 0) == plain.counts.get("to another device", 0)


def test_every_module_param_and_update_is_probed(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**SENTINEL_ONLY))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    batches = []
    monitor._api.write = batches.append  # the api sink receives every step batch in the writer thread
    run_steps(model, optimizer, 2, grad_acc_steps=2)
    monitor.stop()
    modules = [n for n, m in model.named_modules() if not isinstance(m, torch.nn.ModuleList)]  # never called
    # containers that return their last child's output object (attn -> proj, mlp -> mlp.2, model -> head) are
    # not read twice
    repeated = {"", "layers.0.attn", "layers.1.attn", "layers.0.mlp", "layers.1.mlp"}
    assert repeated == _returning_a_childs_output(model)
    modules = [m for m in modules if m not in repeated]
    params = dict(model.named_parameters())
    assert len(batches) == 2
    for batch in batches:
        assert len(batch.flags) == len(batch.flag_keys)
        names = {(k.family, k.name, k.micro_step) for k in batch.flag_keys}
        for micro in (0, 1):
            assert {("actv", f"{m}.output", micro) for m in modules} <= names
            assert {("grad_unreduced", p, micro) for p in params} <= names
        assert {("param_updated", p, None) for p in params} <= names
        indices = [k.call_index for k in batch.flag_keys]
        assert indices == sorted(indices) and len(set(indices)) == len(indices)
    # a weight's probe is its fp32 L2 norm (twice: a pair per key): check the last step's updated weights directly
    last = {k.name: v for k, v in zip(batches[-1].flag_keys, batches[-1].flags) if k.family == "param_updated"}
    for name, param in params.items():
        norm = float(torch.linalg.vector_norm(param.detach(), dtype=torch.float32))
        assert last[name][0] == last[name][1] and abs(last[name][0] - norm) <= 1e-6 * (1 + norm)
    # an activation's probe is its (min, max)
    assert all(low <= high for k, (low, high) in zip(batches[-1].flag_keys, batches[-1].flags) if k.family == "actv")
    assert (monitor.output_dir / "anomalies.jsonl").read_text() == ""


def _returning_a_childs_output(model) -> set:
    seen, repeated, handles, alive = set(), set(), [], []
    for name, module in model.named_modules():
        def hook(m, args, out, name=name):
            alive.append(out)  # ids stay unique while the objects live
            (repeated.add(name) if id(out) in seen else seen.add(id(out)))
        handles.append(module.register_forward_hook(hook))
    tokens = torch.zeros(1, 4, dtype=torch.long)
    model(tokens)
    for handle in handles:
        handle.remove()
    return repeated


class _StackedDtypes(TorchDispatchMode):
    """The set of input dtypes of every stack and cat that runs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.stack, torch.ops.aten.cat):
            self.calls.append({t.dtype for t in args[0]})
        return func(*args, **(kwargs or {}))


def test_probes_of_mixed_dtypes_are_stacked_one_dtype_at_a_time_in_their_order():
    values = [torch.tensor(1.5, dtype=torch.bfloat16), torch.tensor(1e300, dtype=torch.float64),
              torch.tensor(-2.0), torch.tensor(math.nan, dtype=torch.bfloat16), torch.tensor(-math.inf),
              torch.tensor(-1e-300, dtype=torch.float64), torch.tensor(7.0, dtype=torch.bfloat16)]
    with _StackedDtypes() as seen:
        got = sentinel.stacked(values)
    assert seen.calls and all(len(dtypes) == 1 for dtypes in seen.calls)
    want = torch.stack(values)
    assert got.dtype == want.dtype == torch.float64  # fp64's extremes stay exact
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_probes_read_on_the_host_and_device_probes_are_filled_together_in_their_order(monkeypatch):
    """CPU probes are kept as floats, an accelerator's as device scalars (here CPU tensors stand in for them):
    a step holding both fills one [keys, 2] tensor, exact, in key order."""
    probes, host_probe = sentinel._Probes(), sentinel.probe
    device_pairs = iter([(torch.tensor(-1.5, dtype=torch.bfloat16), torch.tensor(2.5, dtype=torch.bfloat16))])
    monkeypatch.setattr(sentinel, "probe", lambda tensor: next(device_pairs) if tensor.dtype == torch.bfloat16
                        else host_probe(tensor))
    probes.add("a", torch.tensor([1.0, 1e300], dtype=torch.float64))
    probes.add("b", torch.zeros(2, dtype=torch.bfloat16))
    probes.add("c", torch.tensor([1.0, math.nan]))
    probes.add_norms(["d"], [torch.tensor([3.0, 4.0])])
    got = probes.filled()
    assert probes.keys == ["a", "b", "c", "d"] and got.dtype == torch.float64
    want = torch.tensor([[1e300, 1e300], [-1.5, 2.5], [math.nan, math.nan], [5.0, 5.0]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_a_bf16_models_probes_are_stacked_by_dtype_and_name_the_fault(output_dir, write_config, monkeypatch):
    """A bf16 model with the accelerators' probe, (min, max) in bf16 beside the weights' fp32 norms: every
    stack of the step takes one dtype (on CUDA a mixed one costs a kernel per probe), and the probes are
    the tensors' own figures, a NaN named where it was put."""
    monkeypatch.setattr(sentinel, "probe", lambda tensor: torch.aminmax(tensor.detach()))
    model = make_model().to(torch.bfloat16)
    seen = {}
    target = model.get_submodule("layers.1.mlp.0")
    target.register_forward_hook(lambda m, args, out: seen.setdefault(len(seen), out.detach().clone()))
    target.register_forward_hook(lambda m, args, out: out * math.nan if len(seen) == 3 else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = TrainerMon(write_config(**SENTINEL_ONLY))
    monitor.set_monitor(model, optimizer=optimizer)
    batches = []
    monitor._api.write = batches.append
    with _StackedDtypes() as stacks:
        run_steps(model, optimizer, 3)
    monitor.stop()
    assert stacks.calls and all(len(dtypes) == 1 for dtypes in stacks.calls)
    probes = [{(k.family, k.name): tuple(v) for k, v in zip(b.flag_keys, b.flags)} for b in batches]
    assert {(k.family, str(k.dtype)) for k in batches[0].flag_keys} >= {("actv", "torch.bfloat16")}
    low, high = torch.aminmax(seen[0])
    assert probes[0][("actv", "layers.1.mlp.0.output")] == (float(low), float(high))
    assert all(math.isfinite(x) for pair in probes[1].values() for x in pair)
    assert all(math.isnan(x) for x in probes[2][("actv", "layers.1.mlp.0.output")])
    first = (monitor.output_dir / "anomalies.jsonl").read_text().splitlines()[0]
    assert '"module": "layers.1.mlp.0"' in first and '"step": 2' in first


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_cpu_probe_tells_every_fault_whatever_its_sum_does(dtype):
    """On CPU a finite sum stands for (min, max); a sum that overflows from finite values (fp32's range, here
    for bf16 and fp32) hands the tensor to aminmax, which finds them finite."""
    big = torch.finfo(dtype).max
    cases = {None: torch.tensor([1.0, -2.0, 3.0]), sentinel.NAN: torch.tensor([1.0, math.nan, 3.0]),
             sentinel.POS_INF: torch.tensor([1.0, math.inf]), sentinel.NEG_INF: torch.tensor([-math.inf, 1.0]),
             sentinel.BOTH_INF: torch.tensor([-math.inf, math.inf])}
    for found, values in cases.items():
        low, high = sentinel.probe(values.to(dtype))
        assert sentinel.verdict("actv", float(low), float(high)) == found, (dtype, values)
    low, high = sentinel.probe(torch.full((4,), big, dtype=dtype))     # finite; for bf16 and fp32 its sum is not
    assert sentinel.verdict("actv", float(low), float(high)) is None
    if dtype != torch.float16:                                          # fp16 is summed in fp32
        assert (float(low), float(high)) == (float(big), float(big))
