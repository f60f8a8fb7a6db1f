"""What computing a language model's output (its vocabulary projection) in
float32 costs under mixed_bfloat16, and what it buys.

kmp leaves the layer that produces a model output in the model's policy
and casts the output to float32 where it is handed on (Keras's loss casts
it; kmp's `predict` does). Before, kmp computed that layer in float32. Two
LMs with a large vocabulary, random weights, no download:

- `--model keras_hub`: a KerasHub Llama causal LM from a small config. Its
  logits come from `ReversibleEmbedding(reverse=True)`, which does not
  autocast its kernel, so Keras computes them in float32 already;
- `--model dense`: token embedding, two Dense(4d) + Dense(d) blocks, and a
  `Dense(vocabulary)` head, the way a user writes one;

each trained under mixed_bfloat16 as

- `keras`: plain Keras (`model.compile`);
- `kmp`: `kmp.compile` (the output layer in bfloat16, its output cast);
- `kmp, output layer float32`: `kmp.compile` with a rule putting the output
  layer in float32 (what kmp did before).

In one process, interleaved (see _timing.py), wall time by default; and the
logits' error against float32 for each. What each way holds in memory is
measured by output_layer_memory.py.

Run: python benchmarks/lm_head.py [--model keras_hub|dense]
     [--vocabulary 32000] [--repeats 5]
"""

import argparse
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import keras_hub
import numpy as np
import tensorflow as tf
from _timing import CLOCKS
from _timing import add_clock_argument
from _timing import interleaved
from _timing import summary

import kmp


def build(model: str, vocabulary: int, hidden: int, layers: int, sequence: int):
    keras.utils.set_random_seed(0)
    if model == "dense":
        inputs = {
            "token_ids": keras.Input((sequence,), dtype="int32", name="token_ids"),
            "padding_mask": keras.Input(
                (sequence,), dtype="int32", name="padding_mask"
            ),
        }
        x = keras.layers.Embedding(vocabulary, hidden)(inputs["token_ids"])
        for _ in range(layers):
            y = keras.layers.Dense(4 * hidden, activation="gelu")(x)
            x = keras.layers.LayerNormalization()(x + keras.layers.Dense(hidden)(y))
        outputs = keras.layers.Dense(vocabulary, name="head")(x)
        return keras.Model(inputs, outputs)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=vocabulary,
        num_layers=layers,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("keras_hub", "dense"), default="keras_hub")
    parser.add_argument("--vocabulary", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    add_clock_argument(parser)
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    rng = np.random.default_rng(0)
    n = args.steps * args.batch_size
    x = {
        "token_ids": rng.integers(1, args.vocabulary, (n, args.sequence)),
        "padding_mask": np.ones((n, args.sequence), "int32"),
    }
    y = np.roll(x["token_ids"], -1, axis=1)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    kmp.set_policy("float32")
    shape = (args.model, args.vocabulary, args.hidden, args.layers, args.sequence)
    reference = build(*shape)
    probe = {k: v[:2] for k, v in x.items()}
    want = np.asarray(reference(probe), "float32")

    runs, errors = {}, {}
    head = "token_embedding" if args.model == "keras_hub" else "head"
    for name in ("keras", "kmp", "kmp, output layer float32"):
        if name == "keras":
            keras.config.set_dtype_policy("mixed_bfloat16")
        else:
            kmp.set_policy("mixed_bfloat16")
        if name == "kmp, output layer float32":
            kmp.set_layer_policy(f"name:{head}", "float32")
        lm = build(*shape)
        lm.set_weights(reference.get_weights())
        optimizer = keras.optimizers.Adam(1e-4)
        if name == "keras":
            lm.compile(optimizer=optimizer, loss=loss)
        else:
            kmp.compile(lm, optimizer=optimizer, loss=loss)
        kmp.clear_layer_policies()
        logits = lm(probe)
        got = np.asarray(logits, "float32")
        errors[name] = {
            "logits dtype": keras.backend.standardize_dtype(logits.dtype),
            "relative error": round(
                float(np.linalg.norm(got - want) / np.linalg.norm(want)), 5
            ),
        }
        lm.fit(x, y, batch_size=args.batch_size, verbose=0)
        runs[name] = lambda lm=lm: lm.fit(x, y, batch_size=args.batch_size, verbose=0)
    result = {
        "benchmark": "lm_head",
        "config": vars(args),
        "logits_vs_float32": errors,
        "speed": summary(interleaved(runs, args.repeats, clock), args.steps, "keras"),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_hub": keras_hub.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
