"""What kmp's `predict` costs against Keras's: kmp casts a model's 16-bit
outputs to float32 (kmp.backend.outputs), traced with Keras's own predict
function. A small MLP under mixed_bfloat16, where a batch costs well under
a millisecond, so that any op outside the graph would show; 500 batches of
64 per run, interleaved in one process.

Run: python benchmarks/predict_cast.py [--repeats 7] [--clock wall|cpu]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import interleaved
from _timing import summary

import kmp

BATCHES, BATCH = 500, 64


def build():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64)(inputs)
    return keras.Model(inputs, keras.layers.Dense(10)(hidden))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    add_clock_argument(parser)
    args = parser.parse_args()
    kmp.set_policy("mixed_bfloat16")
    x = np.random.default_rng(0).random((BATCHES * BATCH, 32), "float32")
    plain = build()
    plain.compile(loss="mse")
    ours = kmp.compile(build(), optimizer="sgd", loss="mse")
    dtypes = {
        "keras": str(plain.predict(x[:BATCH], verbose=0).dtype),
        "kmp": str(ours.predict(x[:BATCH], verbose=0).dtype),
    }
    runs = {
        "keras": lambda: plain.predict(x, batch_size=BATCH, verbose=0),
        "kmp": lambda: ours.predict(x, batch_size=BATCH, verbose=0),
    }
    times = interleaved(runs, args.repeats, CLOCKS[args.clock])
    print(
        json.dumps(
            {
                "benchmark": "predict_cast",
                "returns": dtypes,
                "per_batch": summary(times, BATCHES, "keras"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
