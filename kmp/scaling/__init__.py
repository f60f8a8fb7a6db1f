"""Loss scaling: the settings, the state machine, the object that holds a
scale, `kmp.LossScaleOptimizer`, the overflow record, the applied-steps
loss, the saved-state format, the gradients contract, LoRA adapter checks,
and the telemetry metric."""
