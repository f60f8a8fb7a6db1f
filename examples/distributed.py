"""The same fit and custom loop under tf.distribute.MirroredStrategy.

kmp builds no distribution of its own: create the model and the optimizer
inside `strategy.scope()` as usual. Every replica agrees on each step's
finite/non-finite decision, so a NaN on one replica skips the step on all.

This script splits the CPU into two logical devices to show two replicas on
any machine; on a GPU machine use `tf.distribute.MirroredStrategy()`.

Run: python examples/distributed.py
"""

import tensorflow as tf

# Two logical CPUs (must come before TensorFlow runs anything).
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import kmp  # noqa: E402

kmp.set_policy("mixed_float16")
keras.utils.set_random_seed(0)  # the same weights every run
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
print(f"replicas: {strategy.num_replicas_in_sync}")

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 16)).astype("float32")
y = (x[:, :4].sum(axis=1) > 0).astype("float32")
x[100, 0] = np.nan  # one poisoned example: its step is skipped on every replica

# 1. model.fit
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1, activation="sigmoid"),
        ]
    )
    kmp.compile(
        model, optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"]
    )
history = model.fit(x, y, batch_size=64, epochs=3, verbose=0, shuffle=False)
print(
    f"fit: accuracy {history.history['accuracy'][-1]:.3f}, "
    f"skipped steps {history.history['skipped_steps_total'][-1]:g}, "
    f"replicas checked: {kmp.debug.verify_replicas(model.optimizer)}"
)

# 2. A custom loop with ScaledGradientTape and strategy.run
with strategy.scope():
    loop_model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3))
    optimizer.build(loop_model.trainable_variables)
loss_fn = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")
global_batch = 64


@tf.function
def train_step(batch):
    def replica_step(inputs):
        bx, by = inputs
        with kmp.ScaledGradientTape(optimizer) as tape:
            logits = tf.cast(loop_model(bx, training=True), tf.float32)
            loss = loss_fn(by[:, None], logits) / global_batch
        grads = tape.gradient(loss, loop_model.trainable_variables)
        return optimizer.apply(grads, loop_model.trainable_variables, scaled=False)

    return strategy.run(replica_step, args=(batch,))


dataset = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
)
for _ in range(3):
    for batch in dataset:
        train_step(batch)
predictions = loop_model.predict(x, verbose=0)[:, 0] > 0
print(
    f"loop: accuracy {np.mean(predictions == (y > 0.5)):.3f}, "
    f"skipped steps {int(keras.ops.convert_to_numpy(optimizer.skipped_steps_total))}, "
    f"replicas checked: {kmp.debug.verify_replicas(optimizer)}"
)
