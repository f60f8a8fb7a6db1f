"""What `kmp.export` buys for inference: the bytes of the weights and of the
`.keras` file, the trained model's (float32 variables) against the
export's (16-bit), and how far the export's predictions move.

ResNet-50 (random weights, 128x128x3, 1000 classes) and a KerasHub Llama
(random weights; 4 blocks, hidden 256, vocabulary 8000), prepared by kmp
under mixed_bfloat16 (and ResNet-50 under mixed_float16), each exported in
the policy's 16-bit dtype. Predictions: one batch, the largest relative
difference to the trained model's float32 `predict`, over its largest
absolute value.

Run: python benchmarks/export_size.py
"""

import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from _timing import cpu_model

import kmp


def resnet():
    keras.utils.set_random_seed(0)
    model = keras.applications.ResNet50(weights=None, input_shape=(128, 128, 3))
    x = np.random.default_rng(0).normal(size=(4, 128, 128, 3)).astype("float32")
    return model, x


def llama():
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=8000,
        num_layers=4,
        num_query_heads=8,
        num_key_value_heads=8,
        hidden_dim=256,
        intermediate_dim=1024,
    )
    model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    tokens = np.random.default_rng(0).integers(1, 8000, (2, 64)).astype("int32")
    return model, {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}


def weight_bytes(model) -> int:
    return sum(
        int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
        if w.dtype != "bfloat16"
        else int(np.prod(w.shape)) * 2
        for w in model.weights
    )


def row(name, build, policy, dtype, folder):
    kmp.set_policy(policy)
    model, x = build()
    kmp.prepare(model)
    trained = os.path.join(folder, f"{name}-{policy}.keras")
    model.save(trained)
    exported_path = os.path.join(folder, f"{name}-{policy}-{dtype}.keras")
    exported = kmp.export(model, exported_path, dtype, sample=x)
    expected = np.asarray(model.predict(x, verbose=0), "float32")
    got = np.asarray(exported.predict(x, verbose=0), "float32")
    return {
        "model": name,
        "policy": policy,
        "export": dtype,
        "weights MB": round(weight_bytes(model) / 2**20, 1),
        "export weights MB": round(weight_bytes(exported) / 2**20, 1),
        "file MB": round(os.path.getsize(trained) / 2**20, 1),
        "export file MB": round(os.path.getsize(exported_path) / 2**20, 1),
        "max |diff| / max |y|": float(
            np.max(np.abs(got - expected)) / np.max(np.abs(expected))
        ),
    }


def main():
    print(json.dumps({"cpu": cpu_model()}))
    with tempfile.TemporaryDirectory() as folder:
        for name, build, policy, dtype in [
            ("resnet50", resnet, "mixed_bfloat16", "bfloat16"),
            ("resnet50", resnet, "mixed_float16", "float16"),
            ("llama", llama, "mixed_bfloat16", "bfloat16"),
        ]:
            print(json.dumps(row(name, build, policy, dtype, folder)))


if __name__ == "__main__":
    main()
