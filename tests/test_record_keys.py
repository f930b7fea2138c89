"""Record keys: one object per set of fields, whatever form a hook gives its shape and dtype in."""
import torch

from trainmon.core.records import record_key


def test_a_key_keeps_plain_fields_and_is_made_once():
    key = record_key("actv", "layers.0.output", 0, 1, 5, torch.Size([2, 3]), torch.bfloat16)
    assert key.dtype == "torch.bfloat16" and key.shape == (2, 3) and type(key.shape) is tuple
    assert record_key("actv", "layers.0.output", 0, 1, 5, (2, 3), torch.bfloat16) is key
    assert record_key("actv", "layers.0.output", 0, 1, 5, (2, 3), "torch.bfloat16") == key
    other = record_key("actv", "layers.0.output", 0, 1, 5, (2, 3), torch.float32)
    assert other != key and other.dtype == "torch.float32"
