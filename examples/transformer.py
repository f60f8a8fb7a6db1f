"""A small transformer classifier under mixed_float16: kmp computes the
attention scores and the output in float32, leaves Keras's normalization
layers (float32 inside) alone, and its precision report shows, per layer,
what it computes in, what it returns and which rule decided it.

Run: python examples/transformer.py
"""

import keras
import numpy as np

import kmp

kmp.set_policy("mixed_float16")
keras.utils.set_random_seed(0)

VOCAB, LENGTH, CLASSES = 500, 24, 4


def encoder_block(x, name):
    attention = keras.layers.MultiHeadAttention(
        num_heads=4, key_dim=16, dropout=0.1, name=f"{name}_attention"
    )(x, x)
    x = keras.layers.LayerNormalization(name=f"{name}_norm1")(x + attention)
    ffn = keras.layers.Dense(128, activation="relu", name=f"{name}_ffn1")(x)
    ffn = keras.layers.Dense(64, name=f"{name}_ffn2")(ffn)
    return keras.layers.LayerNormalization(name=f"{name}_norm2")(x + ffn)


tokens = keras.Input((LENGTH,), dtype="int32")
x = keras.layers.Embedding(VOCAB, 64, name="embedding")(tokens)
x = encoder_block(x, "block1")
x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
outputs = keras.layers.Dense(CLASSES, activation="softmax", name="classifier")(x)
model = keras.Model(tokens, outputs, name="transformer")

kmp.compile(
    model,
    optimizer=keras.optimizers.Adam(1e-3),
    loss="sparse_categorical_crossentropy",
    metrics=["accuracy"],
)
print(kmp.precision_report(model))

# A task attention solves: the class is the most frequent of 4 marker tokens.
rng = np.random.default_rng(0)
x_data = rng.integers(CLASSES, VOCAB, size=(3000, LENGTH))
y_data = rng.integers(0, CLASSES, size=3000)
for row, label in zip(x_data, y_data, strict=True):
    row[rng.choice(LENGTH, size=6, replace=False)] = label
history = model.fit(
    x_data, y_data, batch_size=64, epochs=4, validation_split=0.2, verbose=2
)
print(f"output dtype: {model(x_data[:2]).dtype}")
print(
    f"loss scale: {history.history['loss_scale'][-1]:g}, "
    f"skipped steps: {history.history['skipped_steps_total'][-1]:g}"
)
print(f"validation accuracy: {history.history['val_accuracy'][-1]:.3f}")
