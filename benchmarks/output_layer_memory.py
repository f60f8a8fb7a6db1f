"""The output layer's cost on a large vocabulary: memory.py's
transformer (vocabulary 8000, sequence 256, batch 16) under kmp and
mixed_bfloat16, its output computed four ways, the tensors' rise over a
warmed-up `fit` of 4 steps (TensorFlow's allocator peak over what was live
before), one way per process:

  f32softmax  the benchmark's model: a float32 softmax output, the loss on
              probabilities (Keras's mixed-precision guide)
  f32dense    the softmax folded into the last Dense (activation='softmax'),
              which kmp computes in float32 (a softmax), the loss on
              probabilities
  f32logits   the head set to float32 (kmp.set_layer_policy; kmp's output
              rule before it became a cast), the loss from logits
  bf16logits  bfloat16 logits cast to float32 by the loss (kmp's output
              rule), the loss from logits

Run: python benchmarks/output_layer_memory.py f32softmax|f32dense|f32logits|bf16logits
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf
from memory import SEQUENCE
from memory import VOCAB
from memory import transformer_trunk

import kmp

variant = sys.argv[1]
kmp.set_policy("mixed_bfloat16")
keras.utils.set_random_seed(0)
layers = keras.layers
tokens, h = transformer_trunk()
if variant == "f32softmax":  # the benchmark's model: softmax in float32
    logits = layers.Dense(VOCAB)(h)
    out = layers.Activation("softmax", dtype="float32")(logits)
    loss = "sparse_categorical_crossentropy"
elif variant == "f32dense":  # the softmax in the output layer itself
    out = layers.Dense(VOCAB, activation="softmax")(h)
    loss = "sparse_categorical_crossentropy"
else:  # 16-bit logits, the loss from logits
    out = layers.Dense(VOCAB, name="head")(h)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
model = keras.Model(tokens, out)
if variant == "f32logits":
    kmp.set_layer_policy("name:head", "float32")
kmp.compile(model, optimizer=keras.optimizers.Adam(1e-4), loss=loss)
rng = np.random.default_rng(0)
x = rng.integers(0, VOCAB, (16 * 4, SEQUENCE)).astype("int32")
y = np.roll(x, -1, axis=1)
model.fit(x[:16], y[:16], batch_size=16, verbose=0)
tf.config.experimental.reset_memory_stats("CPU:0")
base = tf.config.experimental.get_memory_info("CPU:0")["current"]
t = time.perf_counter()
model.fit(x, y, batch_size=16, verbose=0)
peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
step_ms = (time.perf_counter() - t) / 4 * 1000
print(
    f"{variant}: output {model.layers[-1].compute_dtype}, tensors' rise "
    f"{(peak - base) / 2**20:.0f} MiB, {step_ms:.0f} ms/step"
)
