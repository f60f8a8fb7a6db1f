"""What does the default check for a stalled run cost per train step?

After each call of the train function from `fit`, kmp reads each
loss-scale optimizer's count of steps skipped in a row (one scalar read;
`kmp.training.stall`). This trains the same model under `mixed_float16`
two ways, interleaved (see _timing.py):

- checked:   `kmp.compile`, as users run it;
- unchecked: the same, with the check handed to a callback that never
             checks. It takes the watch and renews it before each call,
             as a NonFiniteGuard does (`TrainFunction.watched_by`).

Small batches make the step short, so that a per-step cost shows.

Run: python benchmarks/stall_check_cost.py [--repeats 15] [--batch-size 32]
"""

import argparse
import json
import os

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


class _NoCheck(keras.callbacks.Callback):
    """Stands in for a NonFiniteGuard: it holds the check and never runs it."""

    def on_train_begin(self, logs=None):
        self.model.train_function.watched_by(self)

    def on_train_batch_begin(self, batch, logs=None):
        self.model.train_function.renew_watch()

    def on_train_end(self, logs=None):
        self.model.train_function.watched_by(None)


def build():
    kmp.set_policy("mixed_float16")
    model = kmp.compile(
        mlp(),
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    add_clock_argument(parser)
    args = parser.parse_args()
    tf.config.optimizer.set_experimental_options({"remapping": False})
    x, y = data(args.steps, args.batch_size)
    models = {v: build() for v in ("unchecked", "checked")}
    callbacks = {"unchecked": [_NoCheck()], "checked": []}

    def run(variant):
        models[variant].fit(
            x, y, batch_size=args.batch_size, verbose=0, callbacks=callbacks[variant]
        )

    runs = {v: (lambda v=v: run(v)) for v in models}
    clock = CLOCKS[args.clock]
    result = {"benchmark": "stall_check_cost", "clock": args.clock}
    result["batch_size"] = args.batch_size
    result.update(
        summary(interleaved(runs, args.repeats, clock), args.steps, "unchecked")
    )
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
