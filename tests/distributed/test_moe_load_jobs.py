"""MoE load per layer (`moe_load`) on real expert-parallel jobs: every figure equals the one the job computes from the
router's own decision (Megatron-Core's routing map, DeepSpeed's dispatch mask and counts), added over the step's
micro-steps and the expert-parallel group, so both EP ranks write the same figures of the whole layer."""
import math
import os

import pytest

from launch import torchrun
from verify import assert_norms_match, assert_unpatched, norms, the_run, truth

pytest.importorskip("pandas")
LOAD_FAMILIES = ("moe_load", "moe_expert_load")


def assert_loads(run, out, ranks):
    """The job's figures of every layer on every rank, the same on each EP rank, and some tokens dropped or not."""
    assert assert_norms_match(run, out, ranks, LOAD_FAMILIES) > 0
    written = [norms(os.path.join(run, f"rank_{rank}"), "moe_load") for rank in ranks]
    assert all(w == written[0] for w in written[1:])  # the figures are the layer's, not one rank's shard
    return written[0]


@pytest.mark.parametrize("dispatcher, capacity", [("alltoall", "1.0"), ("allgather", None)])
def test_megatron_expert_parallel_2(tmp_path, dispatcher, capacity):
    pytest.importorskip("megatron.core")
    output_dir = tmp_path / "monitor_output"
    options = ["--moe-experts", "4", "--ep", "2", "--dispatcher", dispatcher, "--moe-load"]
    options += ["--moe-capacity", capacity] if capacity else []
    torchrun("job_megatron.py", 2, ["--out", str(tmp_path), *options], output_dir)
    run = the_run(output_dir)
    written = assert_loads(run, tmp_path, (0, 1))
    dropped = [v for (_, name), v in written.items() if name.endswith("dropped_tokens")]
    assert dropped and (any(v > 0 for v in dropped) if capacity else all(v == 0 for v in dropped))
    layers = {name.rsplit(".", 2)[0] for _, name in written}
    assert layers == {"decoder.layers.0.mlp", "decoder.layers.1.mlp"}
    # the attention features of core_attention's q and k, per micro-step
    assert assert_norms_match(run, tmp_path, (0, 1), ("attention_hook",), per_micro=True) == \
        2 * 3 * 2 * 2 * 3  # ranks x steps x micro-steps x layers x features
    assert_unpatched(tmp_path, (0, 1))  # stop() took trainmon's routing off every router


def test_deepspeed_moe_expert_parallel_2(tmp_path):
    pytest.importorskip("deepspeed")
    output_dir = tmp_path / "monitor_output"
    torchrun("job_deepspeed_moe.py", 2, ["--stage", "1", "--moe-experts", "4", "--ep", "2", "--moe-load",
                                         "--capacity", "0.5", "--out", str(tmp_path)], output_dir)
    run = the_run(output_dir)
    written = assert_loads(run, tmp_path, (0, 1))
    assert any(v > 0 for (_, name), v in written.items() if name.endswith("dropped_tokens"))
    entropy = [v for (_, name), v in written.items() if name.endswith("router_entropy")]
    assert entropy and all(0 < v <= math.log(4) for v in entropy)
    assert truth(tmp_path, 0)["0"]["moe_load"]
