"""Where a training step's time goes, by kind of op: TensorFlow's profiler
over a few steps of a built-in model's `fit` under `kmp.compile`, its
framework-op statistics grouped into matmuls (and convolutions), casts,
normalization, softmax, the non-finite check, the rest of the optimizer,
and everything else.

Self time is summed over the threads that ran each op (2 cores: up to twice
the wall time). The fused optimizer update runs as one XLA program, whose
time the framework-op statistics do not show: `fused_update.py` measures
it alone.

Run (from benchmarks/): python step_profile.py [--model transformer]
     [--policy mixed_bfloat16] [--batch-size 64] [--steps 4]
"""

import argparse
import glob
import json
import os
import tempfile
from collections import defaultdict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _timing import cpu_model

import kmp
from kmp.tools import bench

KINDS = (
    "matmul",
    "cast",
    "normalization",
    "softmax",
    "non-finite check",
    "optimizer (unfused part)",
    "other",
)


def kind_of(op_type: str, name: str) -> str | None:
    """The kind of one framework op (None: idle time and input pipeline)."""
    lowered = name.lower()
    if op_type in ("IDLE", "Dataset") or lowered.startswith("iterator::"):
        return None
    if any(k in op_type for k in ("MatMul", "Einsum", "Conv")):
        return "matmul"
    if op_type == "Cast":
        return "cast"
    if "normalization" in lowered or op_type.startswith("FusedBatchNorm"):
        return "normalization"
    if "softmax" in lowered and "crossentropy" not in lowered:
        return "softmax"
    if op_type in ("IsFinite", "All") or "isfinite" in lowered:
        return "non-finite check"
    if any(k in lowered for k in ("optimizer", "adam", "assignvariable")):
        return "optimizer (unfused part)"
    return "other"


def op_stats(logdir: str) -> list[dict]:
    from tensorflow.python.profiler.internal import _pywrap_profiler_plugin

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    data, _ = _pywrap_profiler_plugin.xspace_to_tools_data(
        paths, "framework_op_stats", {}
    )
    table = json.loads(data)[0]
    columns = [c["id"] for c in table["cols"]]
    return [
        dict(zip(columns, [c.get("v") if c else None for c in row["c"]], strict=True))
        for row in table["rows"]
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=bench.BUILTIN_MODELS, default="transformer")
    parser.add_argument("--policy", default="mixed_bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    kmp.set_policy(args.policy)
    model, make = bench.build_model(args.model)
    kmp.compile(
        model,
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = make(args.steps * args.batch_size)
    model.fit(x, y, batch_size=args.batch_size, verbose=0)  # trace, compile
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        model.fit(x, y, batch_size=args.batch_size, verbose=0)
        tf.profiler.experimental.stop()
        rows = op_stats(logdir)
    by_kind = defaultdict(float)
    top = defaultdict(lambda: defaultdict(float))
    for row in rows:
        kind = kind_of(row["type"], row["operation"])
        if kind is not None:
            by_kind[kind] += row["total_self_time"]
            top[kind][row["type"]] += row["total_self_time"]
    total = sum(by_kind.values())
    print(
        json.dumps(
            {
                "benchmark": "step_profile",
                "machine": cpu_model(),
                "cpus": os.cpu_count(),
                "model": args.model,
                "policy": args.policy,
                "batch_size": args.batch_size,
                "steps": args.steps,
                "self_ms_per_step": round(total / 1000 / args.steps, 1),
                "kinds": {
                    kind: {
                        "share": round(by_kind[kind] / total, 3),
                        "self_ms_per_step": round(by_kind[kind] / 1000 / args.steps, 1),
                        "top_op_types": sorted(
                            top[kind], key=top[kind].get, reverse=True
                        )[:4],
                    }
                    for kind in KINDS
                },
                "tensorflow": tf.__version__,
                "keras": keras.__version__,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
