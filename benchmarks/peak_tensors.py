"""What a training step holds at its peak, tensor by tensor: memory.py's
models and ways, the bytes the live tensors requested at the peak of two
profiled `fit` steps (after one step that traces and compiles), and the
largest of those tensors with the op that made each.

Weights and optimizer slots, allocated before the profiled steps, are not
counted: this is the step's own memory (activations kept for the backward
pass, gradients, temporaries), where a float32 copy that mixed precision
did not remove shows by name.

Run: python benchmarks/peak_tensors.py MODEL POLICY WAY [--top 15]
     e.g. python benchmarks/peak_tensors.py transformer mixed_bfloat16 kmp-lean
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from _allocations import live_at_peak
from _timing import cpu_model
from memory import BATCH
from memory import MODELS
from memory import POLICIES
from memory import WAYS
from memory import compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("policy", choices=POLICIES)
    parser.add_argument("way", choices=WAYS)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    model, x, y = compiled(args.model, args.policy, args.way)
    batch = BATCH[args.model]
    model.fit(x, y, batch_size=batch, verbose=0)  # traces and compiles
    trace = tempfile.mkdtemp()
    options = tf.profiler.experimental.ProfilerOptions(
        host_tracer_level=3, python_tracer_level=0, device_tracer_level=0
    )
    tf.profiler.experimental.start(trace, options=options)
    try:
        twice = (np.concatenate([x, x]), np.concatenate([y, y]))
        model.fit(*twice, batch_size=batch, shuffle=False, verbose=0)
    finally:
        tf.profiler.experimental.stop()
    peak, tensors = live_at_peak(trace)
    print(
        f"{cpu_model()}: {args.model}, {args.policy}, {args.way}: the step's "
        f"tensors at their peak: {peak / 2**20:.0f} MiB"
    )
    by_dtype: collections.Counter = collections.Counter()
    for t in tensors:
        by_dtype[t.dtype] += t.bytes
    print(
        "by dtype: "
        + ", ".join(f"{d} {b / 2**20:.0f} MiB" for d, b in by_dtype.most_common())
    )
    groups: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for t in tensors:
        key = (t.op, t.shape, t.dtype)
        groups[key] += t.bytes
        counts[key] += 1
    print("| MiB | tensors | op | shape | dtype |\n|---|---|---|---|---|")
    for (op, shape, dtype), size in groups.most_common(args.top):
        count = counts[op, shape, dtype]
        print(f"| {size / 2**20:.1f} | {count} | {op} | {shape} | {dtype} |")


if __name__ == "__main__":
    main()
