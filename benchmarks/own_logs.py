"""What does kmp cost on models users write themselves?

A keras-io-style VAE (a subclassed model with no call, a Functional encoder
and decoder, a `train_step` returning its own dict, an overridden
`metrics`), and beside it a Functional MLP with Keras's own `train_step`,
each trained under `mixed_bfloat16` two ways:

- keras: `keras.config.set_dtype_policy` and `model.compile` (plain Keras
  computes the VAE's losses in bfloat16: its encoder and decoder outputs
  are bfloat16);
- kmp:   `kmp.set_policy` and `kmp.compile` (float32 outputs of the models
  the train_step calls, the loss scale and skips added to its own logs by
  kmp's train function).

Step time: interleaved runs in one process (see _timing.py). Peak memory:
one fresh process per variant (`--memory`), VmHWM after a fit and its rise
above the RSS of the compiled model before the first step.

Run: python benchmarks/own_logs.py [--repeats 9]
"""

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _timing import cpu_model
from _timing import interleaved
from _timing import status_mib
from _timing import summary
from keras import layers
from keras import ops

import kmp

POLICY = "mixed_bfloat16"


class Sampling(layers.Layer):
    def call(self, inputs):
        z_mean, z_log_var = inputs
        epsilon = keras.random.normal(ops.shape(z_mean), dtype=z_mean.dtype)
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


class VAE(keras.Model):
    def __init__(self, encoder, decoder):
        super().__init__()
        self.encoder, self.decoder = encoder, decoder
        self.total = keras.metrics.Mean(name="loss")
        self.kl = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total, self.kl]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(
                ops.sum(keras.losses.binary_crossentropy(data, reconstruction), -1)
            )
            kl = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl = ops.mean(ops.sum(kl, axis=1))
            total = reconstruction_loss + kl
            scaled = self.optimizer.scale_loss(total)
        grads = tape.gradient(scaled, self.trainable_weights)
        self.optimizer.apply(grads, self.trainable_weights)
        self.total.update_state(total)
        self.kl.update_state(kl)
        return {"loss": self.total.result(), "kl_loss": self.kl.result()}


def vae(width):
    inputs = keras.Input((784,))
    h = layers.Dense(width, activation="relu")(
        layers.Dense(width, activation="relu")(inputs)
    )
    z_mean, z_log_var = layers.Dense(16)(h), layers.Dense(16)(h)
    encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
    latent = keras.Input((16,))
    h = layers.Dense(width, activation="relu")(
        layers.Dense(width, activation="relu")(latent)
    )
    decoder = keras.Model(latent, layers.Dense(784, activation="sigmoid")(h))
    return VAE(encoder, decoder)


def mlp(width):
    inputs = keras.Input((784,))
    h = inputs
    for _ in range(3):
        h = layers.Dense(width, activation="relu")(h)
    return keras.Model(inputs, layers.Dense(10)(h))


def build(variant, model_name, width):
    keras.utils.set_random_seed(0)
    if variant == "kmp":
        kmp.set_policy(POLICY)
    else:
        keras.config.set_dtype_policy(POLICY)
    model = vae(width) if model_name == "vae" else mlp(width)
    kwargs = {"optimizer": keras.optimizers.Adam(1e-3)}
    if model_name == "mlp":
        kwargs["loss"] = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if variant == "kmp":
        kmp.compile(model, **kwargs)
    else:
        model.compile(**kwargs)
    return model


def data(model_name, steps, batch):
    rs = np.random.RandomState(0)
    x = rs.rand(steps * batch, 784).astype("float32")
    if model_name == "vae":
        return (x,)
    return x, rs.randint(0, 10, len(x))


def memory(variant, model_name, args):
    model = build(variant, model_name, args.width)
    arrays = data(model_name, args.steps, args.batch_size)
    before = status_mib("VmRSS")
    history = model.fit(*arrays, batch_size=args.batch_size, epochs=2, verbose=0)
    peak = status_mib("VmHWM")
    print(
        json.dumps(
            {
                "variant": variant,
                "model": model_name,
                "peak_mb": round(peak, 1),
                "rise_mb": round(peak - before, 1),
                "final_loss": float(history.history["loss"][-1]),
                "keys": sorted(history.history),
            }
        )
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--memory", nargs=2, metavar=("VARIANT", "MODEL"))
    args = parser.parse_args()
    if args.memory:
        memory(*args.memory, args)
        return
    result = {"cpu": cpu_model(), "policy": POLICY, "time": {}, "memory": []}
    for model_name in ("vae", "mlp"):
        arrays = data(model_name, args.steps, args.batch_size)
        models = {v: build(v, model_name, args.width) for v in ("keras", "kmp")}

        def run(variant, models=models, arrays=arrays):
            # The policy each variant was built under, for the fit.
            keras.config.set_dtype_policy(POLICY)
            models[variant].fit(
                *arrays, batch_size=args.batch_size, epochs=1, verbose=0
            )

        times = interleaved(
            {v: (lambda v=v: run(v)) for v in models}, args.repeats, time.process_time
        )
        result["time"][model_name] = summary(times, args.steps, "keras")
        for variant in ("keras", "kmp"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--memory",
                    variant,
                    model_name,
                    "--steps",
                    str(args.steps),
                    "--batch-size",
                    str(args.batch_size),
                    "--width",
                    str(args.width),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            result["memory"].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
