"""The precision core: policies, the layer kinds kmp knows, the rules, a
model's layers as kmp sees them, quantized layers, float32 activity
regularization, and the `'auto'` rule. Imports no TensorFlow (checked by
`lint-imports`)."""
