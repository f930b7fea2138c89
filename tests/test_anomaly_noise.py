"""AnomalySpike and numerical noise: an attention key bias, whose grad is mathematically zero, never alerts
in a healthy run, while a tenfold grad of a real layer still fires at its step; a series at noise level
relative to its family neither fires nor counts as history."""
import json
import math

import pytest
import torch

from trainmon import TrainerMon
from trainmon.anomaly.rules import AnomalySpike

STEPS, SPIKE_STEP, SEQ, DIM, VOCAB = 60, 30, 12, 64, 32
CONFIG = dict(targets={}, wg_distribution=True, mv_distribution=True, ops=["norm", "nans", "infs"], format="csv",
              alert={"rules": [{"rule_name": "AnomalySpike"}]})


class Attention(torch.nn.Module):
    """One softmax attention block. `k.bias` adds q·b to every logit of a query row, a constant that
    softmax cancels: its grad is zero but for float rounding."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.q, self.k, self.v = (torch.nn.Linear(DIM, DIM) for _ in range(3))
        self.out = torch.nn.Linear(DIM, VOCAB)
        # BERT's initialisation keeps the logits small, so the key bias's noise starts so low that its
        # exp_avg_sq norm underflows to 0 in fp32, then rises through ~1e-23 as the weights grow: before the
        # noise level, AnomalySpike fired on it for 18 steps (32 to 49) of this run.
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear):
                torch.nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.embed(tokens)
        logits = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(DIM)
        return self.out(torch.softmax(logits, dim=-1) @ self.v(x))


def train(config_path, spike_param=None):
    """60 AdamW steps under a linear warm-up then cosine decay; `spike_param`'s grad is x10 at SPIKE_STEP."""
    torch.manual_seed(0)
    model = Attention()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=10)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - 10)
    schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[10])
    if spike_param is not None:
        model.get_parameter(spike_param).register_hook(lambda g: g * 10 if step == SPIKE_STEP else None)
    monitor = TrainerMon(config_path)
    monitor.set_monitor(model, optimizer=optimizer)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (8, SEQ), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, dims=1).flatten())
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    monitor.stop()
    path = monitor.output_dir / "anomalies.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def test_attention_key_bias_noise_never_spikes(output_dir, write_config):
    assert train(write_config(**CONFIG)) == []


def test_tenfold_grad_of_a_real_layer_fires_at_its_step(output_dir, write_config):
    spikes = train(write_config(**CONFIG), spike_param="out.bias")
    assert {(a["step"], a["module"]) for a in spikes} == {(SPIKE_STEP, "out.bias")}
    assert "grad" in {a["tensor"] for a in spikes}


def fired(rule, step_values: dict, family="grad_unreduced") -> list:
    """Feeds one step's norms {tag: value} of one family to `rule`; the tags that fire."""
    records = [(tag, family, {"norm": value}) for tag, value in step_values.items()]
    rule.begin_step(records)
    return [tag for tag, _, ops in records if rule.check_record(tag, (), ops)]


def wobble(i: int) -> float:
    return 1.0 + 0.02 * (-1) ** i


def fired_steps(rule, bias_series) -> list[int]:
    return [i for i, v in enumerate(bias_series) if fired(rule, {"weight": wobble(i), "bias": v})]


# A key bias's grad norm: exactly 0 (its squares underflow), then float noise growing with the weights.
NOISE = [0.0] * 15 + [1e-11 * 1.3 ** i for i in range(30)]


def test_noise_level_series_never_fire():
    assert fired_steps(AnomalySpike(noise=0), NOISE)  # judged as a series, it fires (as before `noise`)
    assert fired_steps(AnomalySpike(), NOISE) == []


def test_a_real_tenfold_jump_fires_beside_noise():
    rule = AnomalySpike()
    jumped = [i for i, v in enumerate(NOISE) if fired(rule, {"weight": wobble(i) * (10 if i == 25 else 1), "bias": v})]
    assert jumped == [25]


def test_a_series_leaving_noise_level_warms_up_again():
    rule = AnomalySpike(warmup=5)
    for i in range(20):
        assert fired(rule, {"weight": wobble(i), "bias": 1e-9 * (1 + i % 3)}) == []
    # 1e7 times its noise, yet no spike: its first real values are a new series' warm-up
    for i in range(20, 25):
        assert fired(rule, {"weight": wobble(i), "bias": 0.01 * wobble(i)}) == []
    assert fired(rule, {"weight": wobble(25), "bias": 0.1}) == ["bias"]
    # back at noise level for a step: the history is gone, the warm-up starts over
    assert fired(rule, {"weight": wobble(26), "bias": 0.0}) == []
    assert fired(rule, {"weight": wobble(27), "bias": 0.01}) == []
    assert fired(rule, {"weight": wobble(28), "bias": 0.1}) == []


@pytest.mark.parametrize("family, fires", [("exp_avg_sq", True), ("grad_unreduced", False)])
def test_second_moments_are_noise_at_the_square_of_the_level(family, fires):
    """1e-9 of the largest exp_avg_sq is a grad at ~3e-5 of the largest: real. In a grad family it is noise."""
    rule = AnomalySpike()
    steps = [i for i in range(30)
             if fired(rule, {"largest": wobble(i), "small": 1e-9 * wobble(i) * (10 if i == 20 else 1)}, family)]
    assert steps == ([20] if fires else [])
