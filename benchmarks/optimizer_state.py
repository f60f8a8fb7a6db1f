"""Adam's moments in bfloat16 against float32: accuracy and optimizer memory.

Two tasks, random or bundled data, no download:

  demo   `kmp demo`'s task: scikit-learn's handwritten digits, its MLP (8.5 M
         weights), Adam with cosine decay, 12 epochs; three seeds per
         variant (the seed sets the weights and the order of the batches),
         so that the difference between variants can be read against the
         spread between seeds.
  qlora  `examples/qlora.py`: a small KerasHub Llama, int4 base with LoRA
         adapters, AdamW with 4-step accumulation; one run per variant from
         the same pretrained weights.

Variants: Keras's optimizer (float32 moments), kmp.optimizers' with bfloat16
moments and stochastic rounding (the default), and with rounding to nearest
(to show what the stochastic rounding buys). Optimizer memory: the bytes of
the optimizer's variables.

Run: python benchmarks/optimizer_state.py [--tasks demo qlora] [--seeds 3]
         [--policy auto]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import statistics
import sys

from _timing import cpu_model

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = pathlib.Path(__file__).resolve().parent.parent
VARIANTS = ("float32", "bfloat16-stochastic", "bfloat16-nearest")


def make_adam(variant: str, learning_rate):
    import keras

    import kmp

    if variant == "float32":
        return keras.optimizers.Adam(learning_rate)
    rounding = variant.split("-")[1]
    return kmp.optimizers.Adam(learning_rate, rounding=rounding)


def optimizer_bytes(optimizer) -> int:
    import numpy as np

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in inner.variables
    )


def demo_run(variant: str, seed: int, policy: str, epochs: int = 12) -> dict:
    import keras

    import kmp
    from kmp.tools import demo

    kmp.set_policy(policy)
    keras.utils.set_random_seed(seed)
    x_train, x_val, y_train, y_val = demo.load_digits_split()
    model = demo.build_model("mlp")
    batch = demo.BATCH_SIZE["mlp"]
    steps = epochs * -(-len(x_train) // batch)
    schedule = keras.optimizers.schedules.CosineDecay(demo.LEARNING_RATE["mlp"], steps)
    kmp.compile(
        model,
        optimizer=make_adam(variant, schedule),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch,
        epochs=epochs,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    return {
        "val_accuracy": history.history["val_accuracy"][-1],
        "loss": history.history["loss"][-1],
        "optimizer_bytes": optimizer_bytes(model.optimizer),
    }


def qlora_runs(policy: str, steps: int = 120) -> dict:
    import numpy as np

    qlora = runpy.run_path(str(ROOT / "examples" / "qlora.py"))
    weights = qlora["pretrain"](steps, np.random.default_rng(0))
    results = {}
    for variant in ("float32", "bfloat16"):
        results[variant] = qlora["finetune"](
            weights, policy, "int4", steps, 2e-3, np.random.default_rng(0),
            variant,
        )  # fmt: skip
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["demo", "qlora"])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--policy", default="auto")
    args = parser.parse_args()
    import kmp

    kmp.set_policy(args.policy)
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, policy {kmp.get_policy().name}")
    if "demo" in args.tasks:
        print("\n| demo (digits MLP) | val accuracy per seed | mean | final loss "
              "(mean) | optimizer MiB |")  # fmt: skip
        print("|---|---|---|---|---|")
        for variant in VARIANTS:
            runs = [demo_run(variant, s, args.policy) for s in range(args.seeds)]
            accuracies = [r["val_accuracy"] for r in runs]
            print(
                f"| {variant} | {', '.join(f'{a:.4f}' for a in accuracies)} "
                f"| {statistics.mean(accuracies):.4f} "
                f"| {statistics.mean(r['loss'] for r in runs):.4f} "
                f"| {runs[0]['optimizer_bytes'] / 2**20:.1f} |",
                flush=True,
            )
    if "qlora" in args.tasks:
        print("\n| qlora (int4 + LoRA) | loss per epoch | accuracy before -> after "
              "| optimizer bytes |")  # fmt: skip
        print("|---|---|---|---|")
        for variant, r in qlora_runs(args.policy).items():
            print(
                f"| {variant} moments | {', '.join(f'{v:.3f}' for v in r['losses'])} "
                f"| {r['before']:.3f} -> {r['after']:.3f} "
                f"| {r['optimizer_bytes']:,} |",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
