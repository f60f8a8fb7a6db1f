"""A ScaledGradientTape loop under MultiWorkerMirroredStrategy.

Run as is, it starts two worker processes on this machine (127.0.0.1, free
ports) and prints what each saw; each worker runs the same script with
TF_CONFIG set, as on a real cluster. Worker 1's shard of the second batch
holds a NaN: both workers skip that step, and end with identical weights.

Run: python examples/multi_worker.py
"""

import json
import os
import socket
import subprocess
import sys

TIMEOUT_S = 240


def launch() -> int:
    """Starts two workers, waits (bounded), prints their reports."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    workers = []
    for index in range(2):
        env = dict(os.environ)
        env["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": index}}
        )
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        workers.append(
            subprocess.Popen(
                [sys.executable, __file__],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    reports = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=TIMEOUT_S)
            if worker.returncode != 0:
                print(err[-3000:], file=sys.stderr)
                return 1
            reports.append(json.loads(out.strip().splitlines()[-1]))
    except subprocess.TimeoutExpired:
        print(f"a worker did not finish within {TIMEOUT_S}s", file=sys.stderr)
        return 1
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
    for report in reports:
        print(json.dumps(report))
    return 0


def work() -> None:
    """One worker: TF_CONFIG says which."""
    import keras
    import numpy as np
    import tensorflow as tf

    import kmp

    kmp.set_policy("mixed_float16")
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    global_batch, per_worker = 16, 8

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-1.0], [0.5], [2.0]], "float32")) * 0.1
    x[16 + per_worker + 2, 0] = np.nan  # batch 1, in worker 1's half

    def dataset_fn(context):
        # Worker i takes rows [i*8, i*8+8) of every global batch of 16.
        rows = np.concatenate(
            [
                np.arange(
                    b + context.input_pipeline_id * per_worker,
                    b + (context.input_pipeline_id + 1) * per_worker,
                )
                for b in range(0, len(x), global_batch)
            ]
        )
        return tf.data.Dataset.from_tensor_slices((x[rows], y[rows])).batch(per_worker)

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = kmp.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64)
        optimizer.build(model.trainable_variables)

    @tf.function
    def train_step(batch):
        def replica_step(inputs):
            bx, by = inputs
            with kmp.ScaledGradientTape(optimizer) as tape:
                pred = tf.cast(model(bx), tf.float32)
                loss = tf.reduce_sum(tf.square(pred - by)) / global_batch
            grads = tape.gradient(loss, model.trainable_variables)
            return optimizer.apply(grads, model.trainable_variables, scaled=False)

        return strategy.run(replica_step, args=(batch,))

    data = strategy.distribute_datasets_from_function(dataset_fn)
    applied = [
        bool(strategy.experimental_local_results(train_step(b))[0]) for b in data
    ]
    value = keras.ops.convert_to_numpy
    print(
        json.dumps(
            {
                "worker": index,
                "applied": applied,
                "loss_scale": float(value(optimizer.loss_scale)),
                "skipped_steps_total": int(value(optimizer.skipped_steps_total)),
                "weights": [value(w).round(6).ravel().tolist() for w in model.weights],
                "replicas_agree": kmp.debug.verify_replicas(optimizer) >= 1,
            }
        )
    )


if __name__ == "__main__":
    if "TF_CONFIG" in os.environ:
        work()
    else:
        sys.exit(launch())
