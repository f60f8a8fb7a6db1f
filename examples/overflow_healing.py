"""A forward pass that overflows float16, foreseen and healed by kmp.

Weights pretrained in bfloat16 often hold values whose activations pass
65504, float16's largest value. Loss scaling cannot fix that (it protects
gradients): every step is skipped and the scale falls. Here a small
transformer's feed-forward up-projection is scaled up 1e5x, as such
weights can be, with a normalization after it that brings the values back
in range, so that float32 trains the model as it is. kmp:

1. names the layer before training (`precision_audit(model, sample=...)`);
2. without healing, diagnoses the stall (`NonFiniteGuard`: a forward
   overflow, in that layer);
3. with `OverflowHealer`, moves that layer to float32 in the first steps
   and trains, the loss scale untouched by those overflows;
4. keeps the move through `model.save` / `load_model`: training resumes
   without a new overflow;
5. measures what float16 loses of the gradients at the scale reached.

Run: python examples/overflow_healing.py
"""

import os
import tempfile

import keras
import numpy as np

import kmp

VOCAB, SEQ, DIM = 128, 16, 32


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(tokens)
    a = keras.layers.LayerNormalization()(x)
    x = x + keras.layers.MultiHeadAttention(4, DIM // 4, name="attn")(a, a)
    f = keras.layers.LayerNormalization()(x)
    f = keras.layers.Dense(4 * DIM, activation="gelu", name="ffn_up")(f)
    f = keras.layers.LayerNormalization(name="ffn_norm")(f)  # back in range
    x = x + keras.layers.Dense(DIM, name="ffn_down")(f)
    x = keras.layers.GlobalAveragePooling1D()(x)
    model = keras.Model(tokens, keras.layers.Dense(4, name="head")(x))
    up = model.get_layer("ffn_up")
    up.kernel.assign(up.kernel * 1e5)  # as bfloat16-pretrained weights can be
    return model


rng = np.random.default_rng(0)
x = rng.integers(0, VOCAB, size=(256, SEQ)).astype("int32")
y = (x[:, :4] % 4).sum(axis=1) % 4  # a label the tokens decide

kmp.set_policy("mixed_float16")
model = kmp.compile(
    build(),
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)

print("1. Before training, the range check on a sample names the layer:")
audit = kmp.debug.precision_audit(model, sample=x[:64])
overflowing = [r for r in audit.risks if r.kind == "float16 overflow"]
for risk in overflowing:
    print(f"   {risk.layer}: {risk.detail}")

print("\n2. Without healing, every step overflows and the guard says why:")
guard = kmp.callbacks.NonFiniteGuard(max_consecutive_skips=3, probe=x[:64])
try:
    model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[guard])
except kmp.callbacks.TrainingCollapsedError as error:
    print("\n".join("   " + line for line in str(error).splitlines()))

print("\n3. With OverflowHealer, the layer moves to float32 and training goes on:")
model = kmp.compile(
    build(),
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
healer = kmp.callbacks.OverflowHealer(verbose=0)
history = model.fit(x, y, batch_size=32, epochs=4, verbose=0, callbacks=[healer])
for heal in healer.heals:
    print(f"   {heal}")
print(
    f"   applied_loss {history.history['applied_loss'][0]:.3f} -> "
    f"{history.history['applied_loss'][-1]:.3f}, "
    f"skipped {int(model.optimizer.skipped_steps_total)} steps, "
    f"loss scale {float(model.optimizer.loss_scale.numpy()):g}"
)

print("\n4. Saved and loaded, the healed precision stays:")
path = os.path.join(tempfile.mkdtemp(), "healed.keras")
model.save(path)
loaded = keras.models.load_model(path)
again = kmp.callbacks.OverflowHealer(verbose=0)
loaded.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[again])
print(
    f"   ffn_up computes in {loaded.get_layer('ffn_up').compute_dtype}; "
    f"forward overflows after the resume: {again.forward_overflows}"
)

print("\n5. What float16 loses of the gradients at the scale reached:")
underflow = kmp.debug.gradient_underflow(model, x, y)
print(f"   {underflow.flushed_fraction:.2%} of the gradient values flush to zero")
