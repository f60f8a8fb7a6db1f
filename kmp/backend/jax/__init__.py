"""kmp's JAX edge: what only Keras's JAX backend needs (a skipped step
written as a functional condition, the train function's telemetry read from
the step's returned state)."""
