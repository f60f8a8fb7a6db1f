"""Where a forward pass first overflowed: a probe that, traced into a
training step, records the first op whose output holds inf/NaN.

`ForwardProbe(loss)` is called while the step is traced, after the loss is
computed (`kmp.LossScaleOptimizer.scale_loss` calls it): every float op of
the forward pass is in the step's graph by then. For each one it adds a
finite check of its output (one pass over each activation, the whole cost,
paid only while the probe is traced in), and it writes the position of the
first non-finite one (in the order the ops were created, which is the
forward order) to a variable, -1 when there is none. `layer_at(model)`
names the layer whose call ran that op, through the name scopes
`kmp.backend.tracing` reads; a cast Keras made for a layer's input is
attributed to that layer (Keras casts a layer's inputs outside its scope).

Only ops with a 16-bit output are checked (casts to 16-bit included):
a float32 op cannot overflow float16, and its infinities are deliberate
(a `-inf` mask) or float32's own. Left out, as in `kmp.backend.ranges`:
data movement, and the tensors that flow into a softmax (scores and
masks).
"""

from __future__ import annotations

from kmp.backend import tracing

_SIXTEEN = ("float16", "bfloat16")


def _candidate(op) -> bool:
    """An op that computes a 16-bit value (a cast to 16-bit included): a
    float32 op cannot overflow float16, and its infinities are deliberate
    (a `-inf` mask) or float32's own."""
    if not op.outputs or op.outputs[0].dtype.name not in _SIXTEEN:
        return False
    if op.type == "Cast":
        return True
    return op.type not in tracing.DATA_OPS and not tracing.reaches_softmax(op)


class ForwardProbe:
    """Records the first op of a traced forward pass whose output is
    non-finite (see the module docstring). Create it eagerly, outside
    any traced function."""

    def __init__(self):
        import tensorflow as tf

        self.first = tf.Variable(-1, dtype=tf.int64, trainable=False)
        # The largest finite |activation| of the layers `measure` names.
        self.peak = tf.Variable(0.0, dtype=tf.float32, trainable=False)
        self._ops: tuple = ()
        self._model = None
        self._measured: tuple = ()

    def measure(self, model, layers) -> None:
        """Has the steps traced from now on record, in `peak`, the largest
        finite |value| the float ops of `layers` (and of their sublayers)
        produce, e.g. a layer just moved to float32: what its activations
        reach there. Resets `peak`."""
        self._model = model
        self._measured = tuple(layers)
        self.peak.assign(0.0)

    def __call__(self, loss) -> None:
        import tensorflow as tf

        ops = [op for op in loss.graph.get_operations() if _candidate(op)]
        if not ops:
            return
        finite = tf.stack(
            [tf.reduce_all(tf.math.is_finite(t)) for op in ops for t in op.outputs[:1]]
        )
        bad = tf.logical_not(finite)
        first = tf.where(
            tf.reduce_any(bad),
            tf.argmax(tf.cast(bad, tf.int32)),
            tf.constant(-1, tf.int64),
        )
        # The first overflow since `reset`: a call of the train function may
        # run several steps (`steps_per_execution`).
        self.first.assign(tf.where(self.first >= 0, self.first, first))
        self._ops = tuple(ops)
        if self._measured:
            self._measure_peak(loss.graph)

    def _measure_peak(self, graph) -> None:
        import tensorflow as tf

        ops = [
            op
            for op in graph.get_operations()
            if op.outputs
            and op.outputs[0].dtype.is_floating
            and op.type not in tracing.DATA_OPS
            and not tracing.reaches_softmax(op)
        ]
        chains = tracing.owners(self._model, [op.name for op in ops])
        ids = {id(layer) for layer in self._measured}
        peaks = []
        for op in ops:
            if any(id(layer) in ids for layer in chains[op.name]):
                a = tf.abs(tf.cast(op.outputs[0], tf.float32))
                peaks.append(tf.reduce_max(tf.where(tf.math.is_finite(a), a, 0.0)))
        if peaks:
            self.peak.assign(tf.maximum(self.peak, tf.reduce_max(tf.stack(peaks))))

    def reset(self) -> None:
        self.first.assign(-1)

    def op(self):
        """The first non-finite op of the last step, or None."""
        index = int(self.first.numpy())
        if index < 0 or index >= len(self._ops):
            return None
        return self._ops[index]

    def layer_at(self, model) -> tuple[str, object] | None:
        """(the name of the first non-finite op, the chain of layers whose
        calls ran it, outermost first), or None when the forward passes
        since the last `reset` were finite. A cast that Keras made for a
        layer's input, outside that layer's call, is attributed to the layer
        it casts for."""
        op = self.op()
        if op is None:
            return None
        chain = tracing.owners(model, [op.name])[op.name]
        if op.type == "Cast" and op.outputs[0].consumers():
            consumer = op.outputs[0].consumers()[0]
            inner = tracing.owners(model, [consumer.name])[consumer.name]
            # Keras casts a layer's inputs in its caller's scope: the cast's
            # layers are then the outer part of the consumer's.
            if len(inner) > len(chain) and all(
                a is b for a, b in zip(chain, inner, strict=False)
            ):
                chain = inner
        return op.name, chain
