"""Peak training memory: plain Keras against kmp, every policy, each row in a
fresh process.

Two models, random weights and data:

  resnet50     keras.applications.ResNet50(weights=None), 128x128x3 images,
               1000 classes, batch 32
  transformer  4 pre-LN blocks (d 256, 8 heads, feed-forward 1024), sequence
               256, vocabulary 8000, next-token softmax kept in float32 (as
               Keras's mixed-precision guide writes it), batch 16
  transformer-folded  the same with its softmax folded into the last Dense
               (`Dense(8000, activation="softmax", dtype="float32")`, what
               kmp computes for a layer with a softmax activation), as
               `kmp.precision_report` advises for that head

Each trained with Adam by `fit`, one way per process:

  keras        `keras.mixed_precision.set_global_policy(policy)` and
               `model.compile` (Keras wraps float16 in its own
               LossScaleOptimizer)
  kmp          `kmp.set_policy(policy)` and `kmp.compile` (the default:
               skip guard, fused update where kmp's rule fuses)
  kmp-unfused  the same with `fused_update=False`
  kmp-lean     kmp's default, with `kmp.layers.lean(model)` (batch and
               layer normalization keeping their 16-bit input, attention
               its 16-bit probabilities, not float32 copies, for the
               backward pass)

Per row, two measures of memory, with the median step time:

  process   the resident memory of the process once the model is compiled
            and the data made (`VmRSS` before the first step: TensorFlow's
            runtime, the weights, the data), its peak over training
            (`VmHWM`), and the rise (peak minus that base). It counts what
            no allocator of TensorFlow's sees: XLA's compiler, oneDNN's
            caches, memory the C library keeps after it is freed.
  tensors   the same three read from TensorFlow's own allocator
            (`tf.config.experimental.get_memory_info("CPU:0")`: the bytes of
            live tensors, and their peak): what training holds at its peak
            (gradients, optimizer slots, what is saved for the backward
            pass, copies). On a GPU this is the device memory.

Linux only (reads /proc/self/status).

Run: python benchmarks/memory.py [--models resnet50 transformer]
         [--policies float32 mixed_bfloat16 mixed_float16]
         [--ways keras kmp kmp-unfused] [--steps 4]
     (one row: --row resnet50 float32 kmp --json)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _timing import cpu_model
from _timing import status_mib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

MODELS = ("resnet50", "transformer", "transformer-folded")
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
WAYS = ("keras", "kmp", "kmp-unfused", "kmp-lean")
BATCH = {"resnet50": 32, "transformer": 16, "transformer-folded": 16}
IMAGE, CLASSES = 128, 1000
SEQUENCE, VOCAB, WIDTH, HEADS, BLOCKS = 256, 8000, 256, 8, 4


def transformer_trunk():
    """The transformer's token input and its last normalized hidden state,
    before the output layer."""
    import keras

    layers = keras.layers
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    h = layers.Embedding(VOCAB, WIDTH)(tokens)
    for _ in range(BLOCKS):
        a = layers.LayerNormalization()(h)
        a = layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(a, a, use_causal_mask=True)
        h = h + a
        f = layers.LayerNormalization()(h)
        f = layers.Dense(4 * WIDTH, activation="gelu")(f)
        h = h + layers.Dense(WIDTH)(f)
    return tokens, layers.LayerNormalization()(h)


def build(name: str):
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    batch = BATCH[name]
    if name == "resnet50":
        model = keras.applications.ResNet50(
            weights=None, input_shape=(IMAGE, IMAGE, 3), classes=CLASSES
        )
        x = rng.random((batch, IMAGE, IMAGE, 3), "float32")
        y = rng.integers(0, CLASSES, batch)
        return model, x, y
    layers = keras.layers
    tokens, h = transformer_trunk()
    if name == "transformer-folded":
        # What kmp computes for a softmax Dense, written as a Keras user
        # would for plain Keras.
        outputs = layers.Dense(VOCAB, activation="softmax", dtype="float32")(h)
    else:
        logits = layers.Dense(VOCAB)(h)
        outputs = layers.Activation("softmax", dtype="float32")(logits)
    model = keras.Model(tokens, outputs)
    x = rng.integers(0, VOCAB, (batch, SEQUENCE)).astype("int32")
    return model, x, np.roll(x, -1, axis=1)


def set_policy(policy: str, way: str) -> None:
    """Sets `policy` as the `way` does: Keras's global policy for `keras`,
    `kmp.set_policy` for kmp's ways."""
    import keras

    import kmp

    if way == "keras":
        keras.mixed_precision.set_global_policy(policy)
    else:
        kmp.set_policy(policy)


def compile_way(model, way: str, loss) -> None:
    """Compiles `model` with Adam the `way` says: `model.compile` for
    `keras`, `kmp.compile` for kmp's (`kmp-unfused`: `fused_update=False`)."""
    import keras

    import kmp

    if way == "keras":
        model.compile(optimizer=keras.optimizers.Adam(1e-4), loss=loss)
    else:
        fused = False if way == "kmp-unfused" else None
        kmp.compile(
            model, optimizer=keras.optimizers.Adam(1e-4), loss=loss, fused_update=fused
        )


def compiled(name: str, policy: str, way: str):
    """The model `name` compiled for training under `policy` one `way`, with
    its batch of data: (model, x, y)."""
    import keras

    import kmp

    set_policy(policy, way)
    keras.utils.set_random_seed(0)
    model, x, y = build(name)
    if way == "kmp-lean":
        model = kmp.layers.lean(model)
    compile_way(model, way, "sparse_categorical_crossentropy")
    return model, x, y


def run_row(name: str, policy: str, way: str, steps: int) -> dict:
    import numpy as np
    import tensorflow as tf

    from kmp.tools import runs

    model, x, y = compiled(name, policy, way)
    base = status_mib("VmRSS")
    tf.config.experimental.reset_memory_stats("CPU:0")
    tensors_base = tf.config.experimental.get_memory_info("CPU:0")["current"] / 2**20
    times: list[float] = []
    history = model.fit(
        np.repeat(x, steps, axis=0),
        np.repeat(y, steps, axis=0),
        batch_size=BATCH[name],
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[runs.step_timer(times)],
    )
    peak = status_mib("VmHWM")
    tensors_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20
    return {
        "model": name,
        "policy": policy,
        "way": way,
        "params": model.count_params(),
        "base_mib": round(base, 1),
        "peak_mib": round(peak, 1),
        "rise_mib": round(peak - base, 1),
        "tensors_base_mib": round(tensors_base, 1),
        "tensors_peak_mib": round(tensors_peak, 1),
        "tensors_rise_mib": round(tensors_peak - tensors_base, 1),
        # The first step traces and compiles: the median of the others.
        "median_step_ms": round(1000 * float(np.median(times[1:] or times)), 1),
        "final_loss": round(float(history.history["loss"][-1]), 4),
    }


def _table(rows: list[dict]) -> str:
    by = {(r["model"], r["policy"], r["way"]): r for r in rows}
    lines = [
        "| model | policy | way | process peak MiB | / Keras's | process rise MiB "
        "| tensors peak MiB | / Keras's | tensors rise MiB "
        "| / float32's (same way) | median ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ratio(row, other, key, digits):
        return f"{row[key] / other[key]:.{digits}f}" if other else ""

    for r in rows:
        keras_row = by.get((r["model"], r["policy"], "keras"))
        float32_row = by.get((r["model"], "float32", r["way"]))
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['way']} | {r['peak_mib']:.0f} "
            f"| {ratio(r, keras_row, 'peak_mib', 3)} | {r['rise_mib']:.0f} "
            f"| {r['tensors_peak_mib']:.0f} "
            f"| {ratio(r, keras_row, 'tensors_peak_mib', 3)} "
            f"| {r['tensors_rise_mib']:.0f} "
            f"| {ratio(r, float32_row, 'tensors_rise_mib', 2)} "
            f"| {r['median_step_ms']:.0f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument(
        "--policies", nargs="+", choices=POLICIES, default=list(POLICIES)
    )
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--row", nargs=3, metavar=("MODEL", "POLICY", "WAY"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.row:
        model, policy, way = args.row
        print(json.dumps(run_row(model, policy, way, args.steps)))
        return
    rows = []
    for model in args.models:
        for policy in args.policies:
            for way in args.ways:
                out = subprocess.run(
                    [sys.executable, __file__, "--row", model, policy, way,
                     "--steps", str(args.steps)],
                    capture_output=True, text=True, check=True,
                ).stdout  # fmt: skip
                rows.append(json.loads(out.strip().splitlines()[-1]))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        result = {
            "benchmark": "memory",
            "machine": cpu_model(),
            "cpus": os.cpu_count(),
            "steps": args.steps,
            "rows": rows,
        }
        print(json.dumps(result, indent=2))
        return
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, {args.steps} steps per row")
    print(_table(rows))


if __name__ == "__main__":
    main()
