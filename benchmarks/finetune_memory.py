"""What full fine-tuning, LoRA and QLoRA cost on one KerasHub Llama.

Five ways to fine-tune the same causal LM (random weights, a synthetic
next-token task), each in a fresh process so that its peak memory is its
own:

  full-float32   every weight trains, float32
  full-mixed     every weight trains, under the 16-bit policy ('auto' here,
                 or --policy)
  lora-mixed     LoRA rank 8 / alpha 32 on query and value, base frozen,
                 16-bit policy
  qlora-int8     as lora-mixed, base quantized to int8 (the tied token
                 embedding kept in float: Keras's int8 ReversibleEmbedding
                 passes gradients back too small)
  qlora-int4     as lora-mixed, base quantized to int4 (embedding included)

For each: bytes of the model's variables, of the optimizer's (AdamW, its
moments for what trains), the peak resident memory of the process
(`ru_maxrss`: TensorFlow's runtime included), the median step time and the
final loss. All are compiled with `kmp.compile`.

Run: python benchmarks/finetune_memory.py [--steps 12] [--policy auto]
     (one variant: --variant qlora-int4 --json)
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = ("full-float32", "full-mixed", "lora-mixed", "qlora-int8", "qlora-int4")
VOCAB, LENGTH, BATCH = 8000, 64, 8


def _bytes(variables) -> int:
    import keras
    import numpy as np

    return sum(
        int(np.prod(v.shape))
        * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize
        for v in variables
    )


def run_variant(variant: str, policy: str, steps: int) -> dict:
    import keras
    import keras_hub
    import numpy as np

    import kmp

    kmp.set_policy("float32" if variant == "full-float32" else policy)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=256,
        intermediate_dim=1024,
    )
    lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    float_bytes = _bytes(lm.weights)
    if variant.startswith("qlora"):
        mode = variant.split("-")[1]
        keep = (
            (lambda layer: layer.name != "token_embedding") if mode == "int8" else None
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            lm.quantize(mode, filters=keep)
    if "lora" in variant:
        lm.backbone.enable_lora(8)
        for site in kmp.precision.traversal.walk(lm):
            if getattr(site.layer, "lora_enabled", False):
                site.layer.lora_alpha = 32
    kmp.compile(
        lm,
        optimizer=keras.optimizers.AdamW(1e-3, weight_decay=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, (BATCH, 1))
    tokens = ((start + np.arange(LENGTH + 1)) % VOCAB).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((BATCH, LENGTH), "int32")}
    y = tokens[:, 1:]
    lm.train_on_batch(x, y)  # traces and builds the optimizer
    times, loss = [], None
    for _ in range(steps):
        begin = time.perf_counter()
        loss = lm.train_on_batch(x, y)
        times.append(time.perf_counter() - begin)
    loss = float(loss[0] if isinstance(loss, list) else loss)
    return {
        "variant": variant,
        "policy": kmp.get_policy().name,
        "trainable_params": sum(int(np.prod(w.shape)) for w in lm.trainable_weights),
        "model_bytes": _bytes(lm.weights),
        "float32_model_bytes": float_bytes,
        "optimizer_bytes": _bytes(lm.optimizer.variables),
        "peak_rss_mib": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
        ),
        "median_step_ms": round(1000 * statistics.median(times), 1),
        "final_loss": round(loss, 4),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--policy", default="auto")
    parser.add_argument("--variant", choices=VARIANTS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.policy, args.steps)))
        return
    from _timing import cpu_model

    rows = []
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--variant", variant, "--policy", args.policy,
             "--steps", str(args.steps)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        rows.append(json.loads(out.strip().splitlines()[-1]))
    result = {"benchmark": "finetune_memory", "machine": cpu_model(),
              "cpus": os.cpu_count(), "steps": args.steps, "rows": rows}  # fmt: skip
    print(json.dumps(result, indent=2))
    print()
    print("| variant | policy | trainable params | model MiB | optimizer MiB "
          "| peak RSS MiB | median ms/step | final loss |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['variant']} | {r['policy']} | {r['trainable_params']:,} "
            f"| {r['model_bytes'] / 2**20:.1f} | {r['optimizer_bytes'] / 2**20:.1f} "
            f"| {r['peak_rss_mib']:.0f} | {r['median_step_ms']:.0f} "
            f"| {r['final_loss']:.3f} |"
        )


if __name__ == "__main__":
    main()
