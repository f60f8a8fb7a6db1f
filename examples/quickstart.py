"""Quickstart: one line turns on mixed precision; `fit` trains as usual.

Run: python examples/quickstart.py
"""

import keras
import numpy as np

import kmp

kmp.set_policy("auto")  # the fast, safe policy for this machine

model = keras.Sequential(
    [
        keras.Input((64,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.LayerNormalization(),
        keras.layers.Dense(10, activation="softmax"),
    ]
)
kmp.compile(
    model,
    optimizer="adam",
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 64)).astype("float32")
y = np.argmax(x[:, :10], axis=1)  # a learnable rule
history = model.fit(x, y, epochs=3, batch_size=64, verbose=2)

print(kmp.precision_report(model))
print(f"policy: {kmp.get_policy().name}")
print(f"final accuracy: {history.history['accuracy'][-1]:.3f}")
