"""The NaN sentinel: no host sync in its hooks, one host transfer per step, numerics untouched, buffer growth."""
import torch

from test_anomaly_online import SENTINEL_ONLY
from test_trainer_mon import OpCounter
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.monitor import collector


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
    plain = OpCounter()
    with plain:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run_steps(model, optimizer, 3, grad_acc_steps=2)
    watched = OpCounter()
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
