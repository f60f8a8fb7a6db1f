"""A jitted training loop on Keras's JAX backend, under mixed_float16.

The loop is Keras's own JAX pattern: `model.stateless_call`,
`jax.value_and_grad`, and `optimizer.stateless_apply` on the state the
loop carries. kmp adds one line: the loss is scaled by
`optimizer.scale_loss`, read from the loop's optimizer state through a
`keras.StatelessScope`. `stateless_apply` unscales the gradients, clips
them (the inner optimizer's `global_clipnorm` sees unscaled ones), skips a
step whose gradients overflowed, and moves the scale.

Run: KERAS_BACKEND=jax python examples/jax_custom_loop.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import keras
import numpy as np

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
optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3, global_clipnorm=1.0))
optimizer.build(model.trainable_variables)
loss_fn = keras.losses.SparseCategoricalCrossentropy()


def scaled_loss(trainable, non_trainable, optimizer_values, x, y):
    y_pred, non_trainable = model.stateless_call(
        trainable, non_trainable, x, training=True
    )
    loss = loss_fn(y, y_pred)
    mapping = list(zip(optimizer.variables, optimizer_values, strict=True))
    with keras.StatelessScope(state_mapping=mapping):
        scaled = optimizer.scale_loss(loss)  # the scale this state holds
    return scaled, (loss, non_trainable)


@jax.jit
def train_step(state, x, y):
    trainable, non_trainable, optimizer_values = state
    (_, (loss, non_trainable)), grads = jax.value_and_grad(scaled_loss, has_aux=True)(
        trainable, non_trainable, optimizer_values, x, y
    )
    trainable, optimizer_values = optimizer.stateless_apply(
        optimizer_values, grads, trainable
    )
    return loss, (trainable, non_trainable, optimizer_values)


rng = np.random.default_rng(0)
x = rng.normal(size=(4096, 32)).astype("float32")
y = np.argmax(x[:, :4], axis=1)
state = (
    [v.value for v in model.trainable_variables],
    [v.value for v in model.non_trainable_variables],
    [v.value for v in optimizer.variables],
)
for epoch in range(3):
    order = rng.permutation(len(x))
    losses = []
    for start in range(0, len(x), 64):
        batch = order[start : start + 64]
        loss, state = train_step(state, x[batch], y[batch])
        losses.append(loss)
    # Once per epoch, as Keras's fit does: the state back into the variables.
    for variables, values in zip(
        (model.trainable_variables, model.non_trainable_variables, optimizer.variables),
        state,
        strict=True,
    ):
        for variable, value in zip(variables, values, strict=True):
            variable.assign(value)
    print(
        f"epoch {epoch + 1}: loss {np.mean(losses):.4f}  "
        f"loss scale {float(optimizer.loss_scale):g}  "
        f"skipped steps {int(optimizer.skipped_steps_total)}"
    )

accuracy = np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y)
print(f"train accuracy: {accuracy:.3f}")
