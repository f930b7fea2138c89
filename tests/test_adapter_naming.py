"""Global numbers in parameter and module names (adapters.naming)."""
from trainmon.adapters.naming import renumber


def test_renumber_adds_the_offset_to_whole_path_components_only():
    name = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert renumber(name, "local_experts", 2) == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    assert renumber(name, "layers", 2) == "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
    assert renumber("layers.10", "layers", 4) == "layers.14"
    assert renumber("xlayers.1.layers_2", "layers", 3) == "xlayers.1.layers_2"
    assert renumber(name, "layers", 0) == name
