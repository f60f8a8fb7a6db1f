"""A forward pass that overflows float16: float32, plain Keras under
mixed_float16, kmp without healing, kmp with `OverflowHealer`.

The case, reproducible without a download: a small transformer classifier
(token embedding, 2 blocks of attention and a feed-forward network, mean
pooling) whose second block's feed-forward network is NormFormer-style (a
LayerNormalization between its two projections) and whose up-projection
weights are scaled up 1e5x, as weights pretrained in bfloat16 can be: that
projection's output exceeds float16's 65504, while the normalization after
it brings the values back in range. The function the model computes is
nearly the unscaled model's, so float32 trains it.

Each variant trains from the same weights on the same batches (synthetic
tokens, the label a noisy function of them), Adam 1e-3, and reports: the
final training loss (the mean of the last epoch's applied steps), the loss
on a held-out set afterwards (the comparison), the skipped steps, the final loss
scale, the heals (layer, step, what its activations reached in float32),
the fraction of gradient values float16 flushes to zero at the final scale
(`kmp.debug.gradient_underflow`, kmp's variants), and the median time of a
step after the last heal. A fifth row trains the same model with its weights not scaled
under kmp's mixed_float16: what float16 reaches on this task with no
overflow at all, the fair reference for the healed run. Plain Keras under
mixed_float16 runs at its float16 CPU speed, so it is given only the first
epoch (enough to see it does not train).

With `--seeds N` it trains instead float32, the healed run and the run
with its weights not scaled from N weight initialisations (the same
batches) and prints each one's losses against float32's from the same
weights: how far float16 rounding alone moves the comparison.

Run: python benchmarks/overflow_healing.py [--epochs 3] [--steps 200] [--seeds N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _timing import cpu_model

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VOCAB, SEQ, DIM, HEADS, CLASSES = 256, 32, 64, 4, 4
SCALE = 1e5
NOISE = 0.2
VARIANTS = ("float32", "keras", "kmp", "kmp + healer", "kmp, weights not scaled")


def build(seed: int = 0, scale: float = SCALE):
    import keras

    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="embed")(tokens)
    for i in range(2):
        a = keras.layers.LayerNormalization(name=f"ln_attn_{i}")(x)
        a = keras.layers.MultiHeadAttention(HEADS, DIM // HEADS, name=f"attn_{i}")(a, a)
        x = keras.layers.Add(name=f"res_attn_{i}")([x, a])
        f = keras.layers.LayerNormalization(name=f"ln_ffn_{i}")(x)
        f = keras.layers.Dense(4 * DIM, activation="gelu", name=f"ffn_up_{i}")(f)
        if i == 1:
            f = keras.layers.LayerNormalization(name=f"ffn_norm_{i}")(f)
        f = keras.layers.Dense(DIM, name=f"ffn_down_{i}")(f)
        x = keras.layers.Add(name=f"res_ffn_{i}")([x, f])
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(CLASSES, name="head")(x)
    model = keras.Model(tokens, outputs, name="overflowing_transformer")
    up = model.get_layer("ffn_up_1")
    up.kernel.assign(up.kernel * scale)
    return model


def data(n: int, seed: int = 1):
    """Token sequences; the label is the residue modulo 4 most tokens have
    (a rule mean pooling can learn, order playing no part), replaced by a
    random one for a fifth of them: every variant can learn the rule, and
    the held-out loss then sits near the floor the noise sets, so variants
    are compared where they converge."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, SEQ)).astype("int32")
    counts = np.stack([(x % CLASSES == c).sum(axis=1) for c in range(CLASSES)], 1)
    y = counts.argmax(axis=1)
    noisy = rng.random(n) < NOISE
    y[noisy] = rng.integers(0, CLASSES, int(noisy.sum()))
    return x, y.astype("int32")


def step_times():
    """A callback that keeps each training step's wall time (`.times`)."""
    import keras

    class StepTimes(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times = []

        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    return StepTimes()


def run(variant: str, epochs: int, steps: int, batch: int, seed: int = 0) -> dict:
    import keras

    import kmp

    policy = "float32" if variant == "float32" else "mixed_float16"
    kmp.set_policy(policy)
    model = build(seed, scale=1.0 if variant == "kmp, weights not scaled" else SCALE)
    x, y = data(steps * batch)
    held_out = data(1024, seed=2)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    healer = None
    callbacks = [step_times()]
    if variant == "keras":
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        epochs = 1
    else:
        kmp.compile(model, optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        if variant == "kmp + healer":
            healer = kmp.callbacks.OverflowHealer(verbose=0)
            callbacks.append(healer)
        else:  # a run that stalls is measured to its end, not stopped
            guard = kmp.callbacks.NonFiniteGuard(on_collapse="warn")
            callbacks.append(guard)
    history = model.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
        callbacks=callbacks,
    )  # fmt: skip
    times = callbacks[0].times
    after = healer.heals[-1].step if healer and healer.heals else 5
    optimizer = model.optimizer
    if isinstance(optimizer, kmp.LossScaleOptimizer):
        skipped = int(optimizer.skipped_steps_total)
        scale = float(optimizer.loss_scale) if optimizer.mode != "none" else None
    elif isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        skipped, scale = None, float(optimizer.dynamic_scale)
    else:
        skipped, scale = None, None
    return {
        "variant": variant,
        "epochs": epochs,
        "final loss": history.history.get("applied_loss", history.history["loss"])[-1],
        "held-out loss": model.evaluate(*held_out, verbose=0, batch_size=batch),
        "skipped": skipped,
        "scale": scale,
        "heals": [
            (
                h.layer,
                h.step,
                None if h.magnitude is None else float(f"{h.magnitude:.3g}"),
            )
            for h in healer.heals
        ]
        if healer
        else [],
        "ms/step": 1000 * statistics.median(times[after + 1 :] or times),
        # What float16 loses of the gradients at the scale reached.
        "underflow": kmp.debug.gradient_underflow(
            model, x[:256], y[:256]
        ).flushed_fraction
        if isinstance(optimizer, kmp.LossScaleOptimizer) and policy != "float32"
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="steps per epoch")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--seeds",
        type=int,
        default=0,
        help="train float32, the healed run and the unscaled run from this many "
        "weight seeds instead, and print their losses against float32's",
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_model()}")
    if args.seeds:
        over_seeds(args.seeds, args.epochs, args.steps, args.batch_size)
        return
    rows = [run(v, args.epochs, args.steps, args.batch_size) for v in VARIANTS]
    train_ref, held_ref = rows[0]["final loss"], rows[0]["held-out loss"]
    print(
        "| variant | epochs | final training loss (vs float32) | held-out loss "
        "(vs float32) | skipped | loss scale | heals (layer, step, activations "
        "reached) | gradient values flushed at that scale | ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['epochs']} | {r['final loss']:.4g} "
            f"({r['final loss'] / train_ref:.3f}) | {r['held-out loss']:.4g} "
            f"({r['held-out loss'] / held_ref:.3f}) | "
            f"{r['skipped']} | {r['scale']} | {r['heals'] or '-'} | "
            f"{'-' if r['underflow'] is None else format(r['underflow'], '.2%')} | "
            f"{r['ms/step']:.1f} |"
        )


def over_seeds(seeds: int, epochs: int, steps: int, batch: int) -> None:
    variants = ("float32", "kmp + healer", "kmp, weights not scaled")
    print(
        "| seed | healed: training loss vs float32 | healed: held-out vs float32 "
        "| not scaled: held-out vs float32 | heals (layer, step) | skipped |"
    )
    print("|---|---|---|---|---|---|")
    ratios = {"train": [], "held": [], "unscaled": []}
    for seed in range(seeds):
        ref, healed, unscaled = (
            run(v, epochs, steps, batch, seed=seed) for v in variants
        )
        ratios["train"].append(healed["final loss"] / ref["final loss"])
        ratios["held"].append(healed["held-out loss"] / ref["held-out loss"])
        ratios["unscaled"].append(unscaled["held-out loss"] / ref["held-out loss"])
        heals = [(layer, step) for layer, step, _ in healed["heals"]] or "-"
        print(
            f"| {seed} | {ratios['train'][-1]:.3f} | {ratios['held'][-1]:.3f} | "
            f"{ratios['unscaled'][-1]:.3f} | {heals} | {healed['skipped']} |",
            flush=True,
        )
    for name, values in ratios.items():
        print(
            f"{name}: mean {statistics.mean(values):.3f}, "
            f"from {min(values):.3f} to {max(values):.3f}"
        )


if __name__ == "__main__":
    main()
