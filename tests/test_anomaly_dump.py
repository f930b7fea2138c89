"""alert.dump: the first anomalous module's inputs and output are saved (safetensors + JSON), size-capped."""
import json

import pytest
import torch

from test_anomaly_online import SENTINEL_ONLY, Clock, forward_inf
from training import make_model, run_steps
from trainmon import TrainerMon
from trainmon.hooks.dump_capture import DumpRequest, capture

load_file = pytest.importorskip("safetensors.torch").load_file  # the `dump` extra


def test_first_anomalous_module_is_dumped_once(output_dir, write_config):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clock = Clock(model, 2)
    forward_inf(model, clock, "layers.1.mlp.0", 1, 1)
    seen = {}
    dict(model.named_modules())["layers.1.mlp.0"].register_forward_hook(
        lambda m, args, out: seen.__setitem__("input", args[0].detach().clone()) if clock.at(1, 1) else None)
    monitor = TrainerMon(write_config(**SENTINEL_ONLY, alert={"dump": True}))
    monitor.set_monitor(model, optimizer=optimizer, grad_acc_steps=2)
    run_steps(model, optimizer, 3, grad_acc_steps=2)
    monitor.stop()
    dumps = sorted((monitor.output_dir / "anomaly_dumps").iterdir())
    assert [p.name for p in dumps] == ["step1_micro1_layers.1.mlp.0.json", "step1_micro1_layers.1.mlp.0.safetensors"]
    description = json.loads(dumps[0].read_text())
    assert (description["module"], description["phase"], description["step"], description["micro_step"]) == \
        ("layers.1.mlp.0", "forward", 1, 1)
    tensors = load_file(str(dumps[1]))
    assert set(tensors) == {"input", "output"}
    assert not torch.isfinite(tensors["output"]).all() and description["tensors"]["output"]["infs_in_stored"] > 0
    # the input is the one of the faulty call (micro-step 1 of step 1), and finite
    assert torch.equal(tensors["input"], seen["input"])


def test_capture_is_size_capped():
    request = DumpRequest(rank=0, step=0, micro_step=0, module="m", phase="forward")
    big, small = torch.arange(1000, dtype=torch.float32).reshape(10, 100), torch.ones(3)
    capture(request, [("big", big), ("small", small)], max_bytes=800)
    assert request.tensors["big"].tolist() == list(range(100)) and request.described["big"]["truncated"]
    assert request.described["big"]["shape"] == [10, 100]
    assert torch.equal(request.tensors["small"], small) and not request.described["small"]["truncated"]
