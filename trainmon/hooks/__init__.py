"""The hooks on a training job: module forward and grad hooks (activations and their grads), weight-grad and
optimizer hooks, collectives, the NaN sentinel, L2 features and MoE load, and the step collector they feed (whose
records the engine computes and the writer thread writes)."""
