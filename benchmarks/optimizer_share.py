"""How much of a step is the optimizer update? The 3 x Dense(2048) MLP under
float32 and mixed_bfloat16, with Adam and with plain SGD (one fused-free
elementwise update instead of Adam's several), in one process, interleaved
(see _timing.py). A measurement toward issue #5's bfloat16 targets, taken
with the update as Keras runs it (`fused_update=False`);
benchmarks/fused_update.py measures what fusing it bought.

Run: python benchmarks/optimizer_share.py [--repeats 5]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import interleaved
from _timing import summary

import kmp
from kmp.tools import bench


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args()
    runs = {}
    for policy in ("float32", "mixed_bfloat16"):
        for name, make_optimizer in (
            ("adam", lambda: keras.optimizers.Adam(1e-3)),
            ("sgd", lambda: keras.optimizers.SGD(1e-3)),
        ):
            kmp.set_policy(policy)
            model, make = bench.build_model("mlp")
            kmp.compile(
                model,
                fused_update=False,  # the update as Keras runs it
                optimizer=make_optimizer(),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
            x, y = make(args.steps * args.batch_size)
            model.fit(x[: args.batch_size], y[: args.batch_size], verbose=0)
            runs[f"{policy}/{name}"] = lambda m=model, x=x, y=y: m.fit(
                x, y, batch_size=args.batch_size, verbose=0
            )
    kmp.set_policy("float32")
    result = {"benchmark": "optimizer_share", "model": "mlp", "clock": "cpu"}
    result.update(
        summary(
            interleaved(runs, args.repeats, time.process_time),
            args.steps,
            "float32/adam",
        )
    )
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
