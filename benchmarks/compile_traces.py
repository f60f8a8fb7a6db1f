"""`kmp.compile` and the first step of `fit`: wall time and traces of the
model's `call`, each run in a fresh process.

The model: a subclassed block (multi-head attention, layer normalization,
a feed-forward pair and a head; batch 32, 16 tokens of width 128), built
by a call before `kmp.compile`, as a user builds one. Its `call` counts the
times it runs traced. kmp's plan reads what only a trace shows (which layer
produces the output, what code meets it, whether the attention hands out
its scores) from one trace at the layers' own policies.

  compile_s      kmp.compile's wall time
  compile_traces traces of the model's call during kmp.compile
  first_step_s   the first fit step's wall time (trace and run)
  traces         traces over both

Run: python benchmarks/compile_traces.py [--policies mixed_bfloat16
         mixed_float16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from _timing import cpu_model


def child(policy: str) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import kmp

    traces = [0]

    class Block(keras.Model):
        def __init__(self):
            super().__init__()
            self.attention = keras.layers.MultiHeadAttention(4, 32)
            self.norm = keras.layers.LayerNormalization()
            self.up = keras.layers.Dense(256, activation="gelu")
            self.down = keras.layers.Dense(128)
            self.head = keras.layers.Dense(1)

        def call(self, x):
            if not tf.executing_eagerly():
                traces[0] += 1
            h = self.norm(x + self.attention(x, x))
            return self.head(self.down(self.up(h))[:, 0])

    kmp.set_policy(policy)
    x = np.random.default_rng(0).normal(size=(64, 16, 128)).astype("float32")
    y = np.ones((64, 1), "float32")
    model = Block()
    model(x[:2])
    traces[0] = 0
    start = time.perf_counter()
    kmp.compile(model, optimizer="adam", loss="mse")
    compiled = time.perf_counter()
    compile_traces = traces[0]
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=1, verbose=0)
    done = time.perf_counter()
    return {
        "compile_s": compiled - start,
        "compile_traces": compile_traces,
        "first_step_s": done - compiled,
        "traces": traces[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--policies", nargs="+", default=["mixed_bfloat16", "mixed_float16"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    print(f"CPU: {cpu_model()}")
    print("| policy | compile_s | compile_traces | first_step_s | traces |")
    print("|---|---|---|---|---|")
    for policy in args.policies:
        runs = []
        for _ in range(args.repeats):
            out = subprocess.run(
                [sys.executable, __file__, "--child", policy],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            runs.append(json.loads(out.strip().splitlines()[-1]))
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {policy} | {median['compile_s']:.3f} | {median['compile_traces']:g} "
            f"| {median['first_step_s']:.3f} | {median['traces']:g} |"
        )


if __name__ == "__main__":
    main()
