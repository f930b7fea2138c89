"""Where the `dump` config block's files go in a rank directory (the tensor dump sink writes them, `trainmon
compare` finds them): rank_<R>/dumps/step<S>/{index.json, tensors.safetensors}."""

DUMPS_DIR, INDEX_FILE, TENSOR_FILE = "dumps", "index.json", "tensors.safetensors"
