"""kmp's TensorFlow edge: what only TensorFlow can answer or do (the
machine probe, grappler's settings, graph tracing, the range and precision
passes, `tf.distribute` agreement, the fused XLA update, finite checks). A
second Keras backend needs a new edge here, not a new core.

Importing it registers the machine's part of the policies (`'auto'` and the
float16 CPU fast path) with `kmp.precision.policy`.
"""

from kmp.backend import grappler
from kmp.backend import machine
from kmp.precision import policy

policy.use_machine(machine.resolve_auto, grappler.apply_fast_paths)
