"""Step time under MirroredStrategy over two logical CPUs vs one device, for
information (issue #6): on a 2-core machine two replicas share the same two
cores, so no speed-up is expected.

Run: python benchmarks/mirrored_vs_single.py [--repeats 9]
"""

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()],
)

import keras  # noqa: E402
from _timing import interleaved  # noqa: E402
from _timing import summary  # noqa: E402
from loss_scale_overhead import data  # noqa: E402
from loss_scale_overhead import mlp  # noqa: E402

import kmp  # noqa: E402


def build():
    model = mlp()
    kmp.compile(
        model,
        optimizer=kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch")
    args = parser.parse_args()
    tf.config.optimizer.set_experimental_options({"remapping": False})
    kmp.set_policy("mixed_float16")
    x, y = data(args.steps, args.batch_size)
    single = build()
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        mirrored = build()
    runs = {
        name: (lambda m=m: m.fit(x, y, batch_size=args.batch_size, verbose=0))
        for name, m in (("one_device", single), ("mirrored_2_logical_cpus", mirrored))
    }
    result = {
        "benchmark": "mirrored_vs_single",
        "policy": "mixed_float16",
        "clock": "wall",
    }
    result.update(
        summary(
            interleaved(runs, args.repeats, time.perf_counter), args.steps, "one_device"
        )
    )
    result["tensorflow"], result["keras"] = tf.__version__, keras.__version__
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
