"""What does kmp's telemetry cost per train step?

Trains the same model under `mixed_float16` three ways, interleaved (see
_timing.py):

- bare:    `model.compile` with a kmp.LossScaleOptimizer, no telemetry;
- history: `kmp.compile` (scale and skips in History and the progress bar);
- monitor: `kmp.compile` plus a LossScaleMonitor writing TensorBoard and
           CSV every `--every` steps.

One run is a whole `fit` of `--epochs` epochs, as a monitor is used: its
TensorBoard writer and CSV file are opened once per fit.

Run: python benchmarks/telemetry_overhead.py [--repeats 9] [--every 1]
(with KERAS_BACKEND=jax, on Keras's JAX backend)
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import interleaved
from _timing import summary
from loss_scale_overhead import data
from loss_scale_overhead import mlp

import kmp


def build(variant):
    kmp.set_policy("mixed_float16")
    model = mlp()
    kwargs = {
        "optimizer": kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    }
    if variant == "bare":
        model.compile(**kwargs)
    else:
        kmp.compile(model, **kwargs)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--every", type=int, default=1)
    add_clock_argument(parser)
    args = parser.parse_args()
    if keras.backend.backend() == "tensorflow":
        tf.config.optimizer.set_experimental_options({"remapping": False})
    x, y = data(args.steps, args.batch_size)
    workdir = tempfile.mkdtemp(prefix="kmp-telemetry-")
    models = {v: build(v) for v in ("bare", "history", "monitor")}

    def run(variant):
        callbacks = []
        if variant == "monitor":
            callbacks.append(
                kmp.callbacks.LossScaleMonitor(
                    log_dir=os.path.join(workdir, "tb"),
                    csv_path=os.path.join(workdir, "scale.csv"),
                    every_n_steps=args.every,
                )
            )
        models[variant].fit(
            x,
            y,
            batch_size=args.batch_size,
            epochs=args.epochs,
            verbose=0,
            callbacks=callbacks,
        )

    runs = {v: (lambda v=v: run(v)) for v in models}
    result = {"benchmark": "telemetry_overhead", "monitor_every_n_steps": args.every}
    steps = args.steps * args.epochs  # one run: a fit of --epochs epochs
    clock = CLOCKS[args.clock]
    result["clock"] = args.clock
    result.update(summary(interleaved(runs, args.repeats, clock), steps, "bare"))
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    result["backend"] = keras.backend.backend()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
