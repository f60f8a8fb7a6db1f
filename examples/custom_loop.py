"""A custom training loop under mixed_float16 with kmp's ScaledGradientTape.

The tape scales the loss for the backward pass and hands back unscaled
gradients, so clipping sees true gradient norms; `optimizer.apply` skips
steps whose gradients overflowed and adjusts the loss scale.

Run: python examples/custom_loop.py
"""

import keras
import numpy as np
import tensorflow as tf

import kmp

kmp.set_policy("mixed_float16")

model = kmp.prepare(
    keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(4, activation="softmax"),
        ]
    )
)
optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
loss_fn = keras.losses.SparseCategoricalCrossentropy()
optimizer.build(model.trainable_variables)


@tf.function
def train_step(x, y):
    with kmp.ScaledGradientTape(optimizer) as tape:
        loss = loss_fn(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    grads, _ = tf.clip_by_global_norm(grads, 1.0)  # on unscaled gradients
    applied = optimizer.apply(grads, model.trainable_variables, scaled=False)
    return loss, applied


rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = np.argmax(x[:, :4], axis=1)
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(4096, seed=0).batch(64)

for epoch in range(3):
    losses = [float(train_step(xb, yb)[0]) for xb, yb in dataset]
    print(
        f"epoch {epoch + 1}: loss {np.mean(losses):.4f}  "
        f"loss scale {float(optimizer.loss_scale):g}  "
        f"skipped steps {int(optimizer.skipped_steps_total)}"
    )

accuracy = np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y)
print(f"train accuracy: {accuracy:.3f}")
