"""Writes tests/data/kmp_optimizer_v2.keras: a model compiled by kmp.compile
under mixed_float16 and trained 4 steps, one skipped (scale 1024 -> 512).

The file is checked in so that a change that breaks loading the files this
version writes fails tests/test_optimizer.py. Run it again only when the
saved layout changes on purpose (and bump kmp.scaling.saved_state.SAVE_FORMAT):

    .venv/bin/python tests/data/make_saved.py
"""

import os
import pathlib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import kmp

HERE = pathlib.Path(__file__).resolve().parent


def main():
    kmp.set_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(1),
        ],
        name="mlp",
    )
    optimizer = kmp.LossScaleOptimizer(keras.optimizers.Adam(1e-3), initial_scale=1024)
    kmp.compile(model, optimizer=optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
    x[9] = np.nan  # batch 2 of 4: skipped
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert float(optimizer.loss_scale) == 512.0
    model.save(HERE / "kmp_optimizer_v2.keras")


if __name__ == "__main__":
    main()
