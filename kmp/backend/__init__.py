"""kmp's TensorFlow edge: what only TensorFlow can answer or do (the
machine probe, grappler's settings, graph tracing, the range and precision
passes, `tf.distribute` agreement, the fused XLA update, finite checks,
the count of live tensors, the reading of a traced backward pass). A
second Keras backend needs a new edge here, not a new core; JAX's is
`kmp.backend.jax`.

TensorFlow is imported inside the functions that use it, not when a module
is imported (`kmp.ScaledGradientTape`'s base class alone is imported with
its module, under Keras's TensorFlow backend only). So `import kmp` under
Keras's JAX backend imports no TensorFlow, and kmp runs where none is
installed. A function that other backends reach answers for them first
(`keras.backend.backend()`), then imports TensorFlow.

Importing it registers the machine's part of the policies (`'auto'` and the
float16 CPU fast path) with `kmp.precision.policy`.
"""

from kmp.backend import grappler
from kmp.backend import machine
from kmp.precision import policy

policy.use_machine(machine.resolve_auto, grappler.apply_fast_paths)
