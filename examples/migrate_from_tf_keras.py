"""Code in the style of TensorFlow's mixed-precision guide (tf.keras 2),
running on kmp: only the import line changed, to `from kmp import
mixed_precision` (tf.keras 2's names, mapped onto kmp).

The guide's custom training loop uses `optimizer.get_scaled_loss(loss)` and
`optimizer.get_unscaled_gradients(grads)`; the optimizer built by
`mixed_precision.LossScaleOptimizer` is a `kmp.LossScaleOptimizer`.

Run: python examples/migrate_from_tf_keras.py
"""

import keras
import numpy as np
import tensorflow as tf

from kmp import mixed_precision  # was: from tensorflow.keras import mixed_precision

mixed_precision.set_global_policy("mixed_float16")

inputs = keras.Input(shape=(784,), name="digits")
x = keras.layers.Dense(256, activation="relu", name="dense_1")(inputs)
x = keras.layers.Dense(256, activation="relu", name="dense_2")(x)
x = keras.layers.Dense(10, name="dense_logits")(x)
# The guide keeps the output float32 by hand; kmp.prepare would do it too.
outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)

optimizer = keras.optimizers.RMSprop()
optimizer = mixed_precision.LossScaleOptimizer(optimizer)
loss_object = keras.losses.SparseCategoricalCrossentropy()

# Stand-in data with the guide's shapes: 784 features, 10 classes, each
# class marked by a bump on its own feature.
rng = np.random.default_rng(0)
y_train = rng.integers(0, 10, 2048)
x_train = rng.random((2048, 784), dtype="float32")
x_train[np.arange(2048), y_train] += 5.0
train_dataset = tf.data.Dataset.from_tensor_slices((x_train, y_train)).batch(64)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        predictions = model(x)
        loss = loss_object(y, predictions)
        scaled_loss = optimizer.get_scaled_loss(loss)
    scaled_gradients = tape.gradient(scaled_loss, model.trainable_variables)
    gradients = optimizer.get_unscaled_gradients(scaled_gradients)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))  # noqa: B905 (as in the guide)
    return loss


for epoch in range(5):
    losses = [float(train_step(x, y)) for x, y in train_dataset]
    print(
        f"epoch {epoch + 1}: loss {np.mean(losses):.4f}, "
        f"loss scale {float(optimizer.loss_scale):g}"
    )

accuracy = np.mean(model.predict(x_train, verbose=0).argmax(axis=1) == y_train)
print(f"train accuracy: {accuracy:.3f}")
