"""Peak live tensors of a full fine-tune with gradient accumulation: plain
Keras against kmp, fused update or not.

The model is a KerasHub causal LM preset (as benchmarks/finetune_table.py
makes: `--preset /tmp/finetune-table/llama/preset`), all weights training,
AdamW, 20 steps of 16 random sequences of 9 tokens, under mixed_bfloat16.
Each variant runs in a fresh process; the figure is TensorFlow's peak of
live tensors on the CPU over `fit`.

Run: python benchmarks/accumulation_memory.py --preset DIR [--steps 2]
     [--variants keras keras-lso kmp kmp-fused]
     (one variant: --variant keras|keras-lso|kmp|kmp-fused; keras-lso is
     plain Keras with its own LossScaleOptimizer, which skips non-finite
     steps as kmp does)
"""

import argparse
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def measure(preset: str, variant: str, steps: int) -> float:
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    import kmp

    kmp.set_policy("mixed_bfloat16")
    lm = keras_hub.models.CausalLM.from_preset(
        preset, dtype=keras.config.dtype_policy()
    )
    lm.preprocessor = None
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(4, 30, (320, 9)).astype("int32"),
        "padding_mask": np.ones((320, 9), "int32"),
    }
    y = rng.integers(4, 30, (320, 9)).astype("int32")
    optimizer = keras.optimizers.AdamW(
        1e-3, gradient_accumulation_steps=steps if steps > 1 else None
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if variant == "keras":
        lm.compile(optimizer=optimizer, loss=loss)
    elif variant == "keras-lso":  # Keras's own skip of non-finite steps
        lm.compile(optimizer=keras.optimizers.LossScaleOptimizer(optimizer), loss=loss)
    else:
        fused = True if variant == "kmp-fused" else None
        kmp.compile(lm, optimizer=optimizer, loss=loss, fused_update=fused)
    tf.config.experimental.reset_memory_stats("CPU:0")
    lm.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return tf.config.experimental.get_memory_info("CPU:0")["peak"] / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--steps", type=int, default=2, help="accumulation steps")
    parser.add_argument("--variant", choices=("keras", "keras-lso", "kmp", "kmp-fused"))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["keras", "kmp", "kmp-fused"],
        help="the variants, each run twice in turn",
    )
    args = parser.parse_args()
    if args.variant:
        print(f"{measure(args.preset, args.variant, args.steps):.1f}")
        return
    for variant in args.variants * 2:
        done = subprocess.run(
            [sys.executable, __file__, "--preset", args.preset,
             "--steps", str(args.steps), "--variant", variant],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(f"{variant}: {done.stdout.strip()} MiB", flush=True)


if __name__ == "__main__":
    main()
