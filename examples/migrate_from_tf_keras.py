"""Code in the style of TensorFlow's mixed-precision guide (tf.keras 2),
running on kmp: only the imports changed.

The guide's custom training loop uses `optimizer.get_scaled_loss(loss)` and
`optimizer.get_unscaled_gradients(grads)`; kmp's LossScaleOptimizer has both.

Run: python examples/migrate_from_tf_keras.py
"""

import keras
import numpy as np
import tensorflow as tf

import kmp

# tf.keras 2:  mixed_precision.set_global_policy('mixed_float16')
kmp.set_policy("mixed_float16")

inputs = keras.Input(shape=(784,), name="digits")
x = keras.layers.Dense(256, activation="relu", name="dense_1")(inputs)
x = keras.layers.Dense(256, activation="relu", name="dense_2")(x)
x = keras.layers.Dense(10, name="dense_logits")(x)
# The guide keeps the output float32 by hand; kmp.prepare would do it too.
outputs = keras.layers.Activation("softmax", dtype="float32", name="predictions")(x)
model = keras.Model(inputs=inputs, outputs=outputs)

# tf.keras 2:  optimizer = mixed_precision.LossScaleOptimizer(optimizer)
optimizer = kmp.LossScaleOptimizer(keras.optimizers.RMSprop())
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
