"""QLoRA-style fine-tuning of a small KerasHub Llama under mixed precision.

The common recipe for fine-tuning a large model on modest hardware: a frozen
base quantized to 4 (or 8) bits, small LoRA adapters on the attention's query
and value projections (float32 masters computing in 16-bit), dynamic loss
scaling under float16, AdamW and gradient accumulation (ms-swift's
`use_fp16`, `gradient_accumulation_steps: 4`, LoRA rank 8 / alpha 32).

Here, with random weights and no download:

1. a small Llama causal LM learns a first synthetic task (count up: each
   token is the previous one plus 1), all weights training, in float32;
2. for each run, the same weights are loaded into a model built under the
   run's policy, quantized (int4; int8 too where the policy is bfloat16:
   Keras refuses int8 under float16; the int8 runs keep the tied token
   embedding in float, see below), LoRA-enabled, and fine-tuned on a
   second task (an instruction token at the start says the step: +2 or
   +3) with AdamW, weight decay 0.01 and 4-step gradient accumulation;
3. each run prints trainable and total parameters, bytes of weights, the
   loss curve, the loss scale, and the accuracy on the new task.

The runs: `'auto'` (the policy kmp picks for this machine) and
`'mixed_float16'`.

The recipe's learning rate, 2e-5, is for 7B models; this model is a
thousand times narrower and trains a few hundred steps, so the example uses
2e-3 (`--learning-rate` sets it).

`--optimizer-state bfloat16` keeps AdamW's moments in bfloat16
(`kmp.optimizers.AdamW`): half the optimizer memory.

Run: python examples/qlora.py [--policies auto mixed_float16] [--steps 120]
     [--modes int4 int8] [--optimizer-state float32|bfloat16]
"""

import argparse
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import keras_hub
import numpy as np

import kmp

VOCAB = 40  # tokens 0..31 are numbers; 32 and 33 the instructions "+2", "+3"
NUMBERS = 32
INSTRUCTIONS = {32: 2, 33: 3}
LENGTH = 16


def make_lm() -> keras.Model:
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def counting(n: int, rng, step_of=None):
    """Sequences of numbers mod 32; with `step_of`, an instruction token
    first that says the step. Returns (inputs, next-token targets, mask of
    the positions to score)."""
    tokens = np.zeros((n, LENGTH), "int32")
    start = rng.integers(0, NUMBERS, n)
    if step_of is None:
        steps = np.ones(n, "int32")
        first = 0
    else:
        instruction = rng.choice(list(step_of), n)
        steps = np.array([step_of[i] for i in instruction], "int32")
        tokens[:, 0] = instruction
        first = 1
    for j in range(first, LENGTH):
        tokens[:, j] = (start + steps * (j - first)) % NUMBERS
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((n, LENGTH - 1), "int32")}
    y = tokens[:, 1:]
    scored = np.zeros_like(y, dtype="float32")
    scored[:, first + 1 :] = 1.0  # after the first number: predictable
    return x, y, scored


def accuracy(lm, x, y, scored) -> float:
    logits = keras.ops.convert_to_numpy(lm(x, training=False))  # one eager call
    predicted = np.argmax(logits, axis=-1)
    return float(((predicted == y) * scored).sum() / scored.sum())


def pretrain(steps: int, rng) -> list:
    kmp.set_policy("float32")
    keras.utils.set_random_seed(0)
    lm = make_lm()
    lm.compile(
        optimizer=keras.optimizers.Adam(3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y, scored = counting(64 * steps // 4, rng)
    lm.fit(
        x, y, sample_weight=scored, batch_size=64, epochs=4, shuffle=False, verbose=0
    )
    print(f"pretrained on counting (+1): accuracy {accuracy(lm, x, y, scored):.3f}")
    return lm.get_weights()


def parameters(model) -> tuple[int, int, int]:
    """(trainable parameters, all parameters, bytes of all weights)."""
    trainable = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    total = sum(int(np.prod(w.shape)) for w in model.weights)
    size = sum(
        int(np.prod(w.shape))
        * np.dtype(keras.backend.standardize_dtype(w.dtype)).itemsize
        for w in model.weights
    )
    return trainable, total, size


def finetune(
    weights, policy, mode, steps, learning_rate, rng, state_dtype="float32"
) -> dict:
    kmp.set_policy(policy)
    resolved = kmp.get_policy().name
    lm = make_lm()
    lm.set_weights(weights)
    _, _, float_bytes = parameters(lm)
    # Keras's int8 ReversibleEmbedding (the tied embedding and output
    # projection) passes back gradients about 5x too small: int8 runs keep
    # it in float; int4 quantizes it too.
    keep = (lambda layer: layer.name != "token_embedding") if mode == "int8" else None
    with warnings.catch_warnings():  # "layer X does not have a quantize method"
        warnings.simplefilter("ignore", UserWarning)
        lm.quantize(mode, filters=keep)
    # KerasHub: freezes the backbone and puts LoRA on query and value.
    lm.backbone.enable_lora(8)
    for site in kmp.precision.traversal.walk(lm):
        if getattr(site.layer, "lora_enabled", False):
            site.layer.lora_alpha = 32  # the product is scaled by alpha / rank
    adamw = dict(weight_decay=0.01, gradient_accumulation_steps=4)
    optimizer = (
        keras.optimizers.AdamW(learning_rate, **adamw)
        if state_dtype == "float32"
        # The moments in bfloat16, stochastically rounded: half the memory.
        else kmp.optimizers.AdamW(learning_rate, state_dtype=state_dtype, **adamw)
    )
    kmp.compile(
        lm,
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    trainable, total, size = parameters(lm)
    x, y, scored = counting(16 * steps, rng, INSTRUCTIONS)
    test = counting(256, np.random.default_rng(1), INSTRUCTIONS)
    before = accuracy(lm, *test)
    history = lm.fit(
        x, y, sample_weight=scored, batch_size=16, epochs=4, shuffle=False, verbose=0
    )
    after = accuracy(lm, *test)
    scaling = lm.optimizer.mode != "none"
    return {
        "policy": resolved,
        "mode": mode,
        "trainable": trainable,
        "total": total,
        "bytes": size,
        "float_bytes": float_bytes,
        "losses": history.history["loss"],
        "loss_scale": float(lm.optimizer.loss_scale) if scaling else None,
        "skipped": int(lm.optimizer.skipped_steps_total),
        "before": before,
        "after": after,
        "optimizer_bytes": sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in lm.optimizer.inner_optimizer.variables
        ),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=["auto", "mixed_float16"])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["int4", "int8"],
        help="base quantizations to fine-tune (int8 only under bfloat16)",
    )
    parser.add_argument(
        "--optimizer-state",
        choices=("float32", "bfloat16"),
        default="float32",
        help="AdamW's moments: Keras's float32, or kmp.optimizers.AdamW's "
        "bfloat16 (stochastic rounding, half the memory)",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = pretrain(args.steps, rng)
    for policy in args.policies:
        kmp.set_policy(policy)
        bfloat16 = kmp.get_policy().compute_dtype == "bfloat16"
        for mode in [m for m in args.modes if m != "int8" or bfloat16]:
            r = finetune(
                weights, policy, mode, args.steps, args.learning_rate, rng,
                args.optimizer_state,
            )  # fmt: skip
            print(
                f"\n{policy} ({r['policy']}), {mode} base + LoRA rank 8 / alpha 32:"
                f"\n  parameters: {r['trainable']:,} trainable of {r['total']:,}"
                f"\n  weights: {r['bytes']:,} bytes ({r['float_bytes']:,} in "
                f"float32 before quantizing)"
                f"\n  loss per epoch: {', '.join(f'{v:.3f}' for v in r['losses'])}"
                f"\n  optimizer state: {r['optimizer_bytes']:,} bytes "
                f"({args.optimizer_state} moments)"
                f"\n  loss scale: {r['loss_scale'] if r['loss_scale'] else 'none'}"
                f"; skipped steps: {r['skipped']}"
                f"\n  instruction task accuracy: {r['before']:.3f} before, "
                f"{r['after']:.3f} after (chance {1 / NUMBERS:.3f})"
            )


if __name__ == "__main__":
    main()
