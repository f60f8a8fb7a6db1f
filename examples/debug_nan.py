"""Reproduce a NaN under float16 and find it with kmp.

A layer whose activations grow past 65504 (float16's largest value) turns
the loss into inf/NaN. kmp's optimizer skips those steps (no weight becomes
NaN), the NonFiniteGuard stops the stalled run and names the layer, and
`kmp.debug.find_nonfinite` shows where to apply the fix.

Run: python examples/debug_nan.py
"""

import keras
import numpy as np

import kmp

kmp.set_policy("mixed_float16")
keras.utils.set_random_seed(0)

model = keras.Sequential(
    [
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="features"),
        keras.layers.Dense(64, activation="relu", name="amplifier"),
        keras.layers.Dense(1, name="score"),
    ]
)
# The bug: an amplifier whose weights blew up (a bad init or a bad checkpoint).
amplifier = model.get_layer("amplifier")
amplifier.kernel.assign(amplifier.kernel * 1e5)

kmp.compile(
    model,
    # A short growth interval, so that the scale visibly recovers after the fix.
    optimizer=kmp.LossScaleOptimizer(
        keras.optimizers.Adam(1e-3), initial_scale=256, dynamic_growth_steps=8
    ),
    loss="mse",
)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16)).astype("float32")
y = x[:, :1] * 2.0

print("1. Before training, the audit lists the spots to watch:")
print(kmp.debug.precision_audit(model))

print("\n2. Training: every step overflows and is skipped.")
guard = kmp.callbacks.NonFiniteGuard(max_consecutive_skips=3, probe=x[:64])
try:
    model.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[guard])
except kmp.callbacks.TrainingCollapsedError as error:
    print(error)
weights_finite = all(np.isfinite(w.numpy()).all() for w in model.weights)
print(
    f"   skipped steps: {int(model.optimizer.skipped_steps_total)}, "
    f"weights all finite: {weights_finite}"
)

print("\n3. find_nonfinite on a batch names the layer:")
report = kmp.debug.find_nonfinite(model, x[:64])
print(report)

print("\n4. Fix the real bug (the blown-up weights) and train again:")
amplifier.kernel.assign(amplifier.kernel / 1e5)
history = model.fit(x, y, batch_size=64, epochs=5, verbose=0)
print(
    f"   loss {history.history['loss'][0]:.4f} -> {history.history['loss'][-1]:.4f}, "
    f"loss scale back up to {history.history['loss_scale'][-1]:g}, "
    f"skipped this epoch {history.history['skipped_steps'][-1]:g}"
)
print(f"found layer: {report.layer}")
