"""The first training step: plain Keras against kmp, each run in a fresh
process.

The first step of `fit` traces the training step (and compiles what it
compiles) before it runs. TensorFlow traces a `tf.function` a second time
when its first trace created variables, and plain Keras builds its
optimizer inside that trace; kmp builds it before the step (with Keras's own
`train_step`), so the step is traced once. This measures what that changes,
with the later steps' time and the memory beside it:

  first_s     the first step's wall time (trace, compile, run)
  step_ms     the median of the later steps
  process     the process's peak resident memory (`VmHWM`) over `fit`
  tensors     the peak bytes of live tensors (TensorFlow's allocator)

Models (random weights and data): `kmp bench`'s `cnn` and `transformer`,
and keras.applications' ResNet50 (`benchmarks/memory.py`'s, 128x128,
batch 32). Ways: `keras` (Keras's policy and `model.compile`), `kmp`
(`kmp.set_policy` and `kmp.compile`, the default), `kmp-unfused`
(`fused_update=False`). Each row runs `--repeats` times, in a new process
each time, ways interleaved; the medians are reported.

Linux only (reads /proc/self/status).

Run: python benchmarks/first_step.py [--models cnn transformer resnet50]
         [--policies float32 mixed_bfloat16] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import memory
from _timing import cpu_model
from _timing import status_mib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("cnn", "transformer", "resnet50")
WAYS = ("keras", "kmp", "kmp-unfused")
STEPS = 4


def run_row(name: str, policy: str, way: str) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    from kmp.tools import bench
    from kmp.tools import runs

    memory.set_policy(policy, way)
    if name == "resnet50":
        model, x, y = memory.build(name)
        batch = memory.BATCH[name]
        x, y = np.repeat(x, STEPS, axis=0), np.repeat(y, STEPS, axis=0)
    else:
        model, make = bench.build_model(name)
        batch = 32
        x, y = make(STEPS * batch)
    # kmp bench's models end in logits, ResNet50 in a softmax.
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=name != "resnet50")
    memory.compile_way(model, way, loss)
    tf.config.experimental.reset_memory_stats("CPU:0")
    tensors_base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    times: list[float] = []
    model.fit(
        x, y, batch_size=batch, shuffle=False, verbose=0,
        callbacks=[runs.step_timer(times)],
    )  # fmt: skip
    tensors_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    return {
        "first_s": times[0],
        "step_ms": 1000 * statistics.median(times[1:]),
        "process_peak_mib": status_mib("VmHWM"),
        "tensors_rise_mib": (tensors_peak - tensors_base) / 2**20,
    }


def _row_in_fresh_process(name: str, policy: str, way: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--row", name, policy, way],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--policies", nargs="+", default=["float32", "mixed_bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row", nargs=3, metavar=("MODEL", "POLICY", "WAY"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(*args.row)))
        return
    rows = []
    for name in args.models:
        for policy in args.policies:
            runs: dict[str, list[dict]] = {way: [] for way in WAYS}
            for i in range(args.repeats):
                for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                    runs[way].append(_row_in_fresh_process(name, policy, way))
            for way in WAYS:
                row = {"model": name, "policy": policy, "way": way}
                for key in runs[way][0]:
                    row[key] = statistics.median(r[key] for r in runs[way])
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"machine": cpu_model(), "rows": rows}, indent=2))
        return
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, medians of {args.repeats} runs")
    print(
        "| model | policy | way | first step s | / Keras's | later steps ms "
        "| process peak MiB | / Keras's | tensors rise MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    keras_rows = {(r["model"], r["policy"]): r for r in rows if r["way"] == "keras"}
    for r in rows:
        k = keras_rows[(r["model"], r["policy"])]
        print(
            f"| {r['model']} | {r['policy']} | {r['way']} | {r['first_s']:.2f} "
            f"| {r['first_s'] / k['first_s']:.2f} | {r['step_ms']:.0f} "
            f"| {r['process_peak_mib']:.0f} "
            f"| {r['process_peak_mib'] / k['process_peak_mib']:.3f} "
            f"| {r['tensors_rise_mib']:.0f} |"
        )


if __name__ == "__main__":
    main()
