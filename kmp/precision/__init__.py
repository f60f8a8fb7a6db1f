"""The precision core: policies, the layer kinds kmp knows, the rules, a
model's layers as kmp sees them, quantized layers, float32 activity
regularization, the `'auto'` rule, and the float32 scope for custom code.
No module here imports TensorFlow, directly or through another kmp module
(checked by `lint-imports`); Keras, which they use, brings its backend."""
