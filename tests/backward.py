"""What a training step's backward pass reads from its forward pass."""

import keras
import tensorflow as tf


def gradient_reads(model, x, y):
    """The (dtype, element count) of every tensor the backward pass of one
    training step of `model` on `(x, y)` (sparse labels, logits) reads from
    the forward pass: what the step holds from the forward pass until the
    gradient is computed."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(x, y).graph
    backward = {op for op in graph.get_operations() if "gradient_tape" in op.name}
    return [
        (t.dtype.name, t.shape.num_elements())
        for op in backward
        for t in op.inputs
        if t.op not in backward and t.shape.num_elements()
    ]
