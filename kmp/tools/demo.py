"""`kmp demo`: the main job. Trains a real model on a real dataset that ships
inside scikit-learn (its handwritten digits: 1,797 8x8 images, no download)
under float32 and under what kmp picks, and shows what precision bought.

Each policy trains in a fresh process (so memory and graph settings are its
own), on the same split with the same seed. This module measures and
returns data; `kmp.tools.cli` prints it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from kmp.tools import runs as _runs

# The default, "mlp", is the one whose step matmuls dominate (8.5 M weights
# in three Dense(2048) layers), so that a speed-up the hardware has shows;
# the small CNN and transformer are mostly overhead on 8x8 images.
MODELS = ("mlp", "cnn", "transformer")
BATCH_SIZE = {"mlp": 128, "cnn": 32, "transformer": 32}
LEARNING_RATE = {"mlp": 1e-3, "cnn": 2e-3, "transformer": 2e-3}
SEED = 0
# Below this many epochs the models have not converged, and the 1-point
# accuracy comparison between policies is not meaningful.
CONVERGED_EPOCHS = 8
CHANCE = 0.1


def learned_floor(converged: bool, float32_accuracy: float) -> float:
    """The validation accuracy under which a policy's run did not learn: 5x
    chance for converged runs. Before, every policy may still be far from
    its final accuracy (the transformer after one epoch), so a run did not
    learn under 2x chance or under half of float32's accuracy from the same
    start: a run that broke (NaN weights, a collapsed loss scale) falls
    behind float32, at chance or on the way to it."""
    if converged:
        return 5 * CHANCE
    return max(2 * CHANCE, 0.5 * float32_accuracy)


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """One policy's training run."""

    policy: str
    median_step_ms: float
    peak_host_rss_mb: float
    val_accuracy: float
    loss_scale_min: float | None
    loss_scale_max: float | None
    skipped_steps: int
    train_loss: tuple[float, ...]  # per epoch
    val_loss: tuple[float, ...]  # per epoch
    loss_scale: tuple[float, ...]  # per step (empty without loss scaling)
    # The peak of live tensors (`kmp.tools.runs.tensors_peak_mb`): memory
    # above the runtime's own.
    peak_tensors_mb: float | None = None


def load_digits_split(seed: int = SEED):
    """scikit-learn's digits, scaled to [0, 1], split 80/20 (stratified)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError(
            "kmp demo reads scikit-learn's bundled digits dataset: "
            "pip install 'kmp[demo]' (or scikit-learn)."
        ) from e
    digits = load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    return train_test_split(
        x, digits.target, test_size=0.2, random_state=seed, stratify=digits.target
    )


def build_model(name: str):
    import keras

    layers = keras.layers
    inputs = keras.Input((8, 8, 1))
    if name == "mlp":
        x = layers.Flatten()(inputs)
        for _ in range(3):
            x = layers.Dense(2048, activation="relu")(x)
        x = layers.Dropout(0.3)(x)
    elif name == "cnn":
        x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        x = layers.BatchNormalization()(x)
        x = layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = layers.MaxPooling2D()(x)
        x = layers.Flatten()(x)
        x = layers.Dense(128, activation="relu")(x)
        x = layers.Dropout(0.3)(x)
    elif name == "transformer":  # the 8 rows are a sequence of 8 tokens
        x = layers.Reshape((8, 8))(inputs)
        x = layers.Dense(64)(x)
        attention = layers.MultiHeadAttention(4, 16, dropout=0.1)(x, x)
        x = layers.LayerNormalization()(x + attention)
        x = layers.LayerNormalization()(x + layers.Dense(64, activation="relu")(x))
        x = layers.GlobalAveragePooling1D()(x)
    else:
        raise ValueError(f"Unknown model {name!r}. Expected one of {MODELS}.")
    outputs = layers.Dense(10, activation="softmax")(x)
    return keras.Model(inputs, outputs, name=f"digits_{name}")


def train_one(model_name: str, policy: str, epochs: int) -> dict:
    """Trains in this process under `policy`; returns the run as a dict."""

    import keras
    import numpy as np

    import kmp

    kmp.set_policy(policy)
    keras.utils.set_random_seed(SEED)
    x_train, x_val, y_train, y_val = load_digits_split()
    model = build_model(model_name)
    # Cosine decay to zero: the last epochs settle, so that policies are
    # compared on converged models rather than on end-of-run noise.
    batch_size = BATCH_SIZE[model_name]
    steps = epochs * -(-len(x_train) // batch_size)
    kmp.compile(
        model,
        optimizer=keras.optimizers.Adam(
            keras.optimizers.schedules.CosineDecay(LEARNING_RATE[model_name], steps)
        ),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    scaled = kmp.get_policy().needs_loss_scaling
    monitor = kmp.callbacks.LossScaleMonitor() if scaled else None

    class Progress(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            print(
                f"  {policy}: epoch {epoch + 1}/{epochs}  loss {logs['loss']:.4f}  "
                f"val_accuracy {logs['val_accuracy']:.4f}",
                file=sys.stderr,
                flush=True,
            )

    times: list[float] = []
    history = model.fit(
        x_train,
        y_train,
        batch_size=batch_size,
        epochs=epochs,
        validation_data=(x_val, y_val),
        verbose=0,
        callbacks=[
            c for c in (monitor, _runs.step_timer(times), Progress()) if c is not None
        ],
    )
    h = history.history
    scales = [r.loss_scale for r in monitor.records] if monitor else []
    return {
        "policy": kmp.get_policy().name,
        "median_step_ms": round(1000 * float(np.median(times[5:] or times)), 3),
        "peak_host_rss_mb": round(_runs.process_peak_mb(), 1),
        "val_accuracy": round(float(h["val_accuracy"][-1]), 4),
        "loss_scale_min": min(scales) if scaled and scales else None,
        "loss_scale_max": max(scales) if scaled and scales else None,
        "skipped_steps": int(h["skipped_steps_total"][-1]) if scaled else 0,
        "train_loss": [float(v) for v in h["loss"]],
        "val_loss": [float(v) for v in h["val_loss"]],
        "loss_scale": scales if scaled else [],
        "peak_tensors_mb": _runs.tensors_peak_mb(),
    }


def policies_to_run() -> list[str]:
    """float32, what 'auto' picks, and mixed_float16 to show loss scaling."""
    from kmp.backend import machine

    chosen = machine.resolve_auto().policy
    order = ["float32", chosen, "mixed_float16"]
    return list(dict.fromkeys(order))


def run(
    model: str = "mlp",
    epochs: int = 12,
    policies: Sequence[str] | None = None,
    timeout: float = 600,
) -> list[DemoRun]:
    """Runs the demo: each policy in a fresh process; returns one DemoRun each.

    Raises:
        ValueError: for an unknown model or a non-positive epoch count.
        RuntimeError: if a run fails (its error output is included).
    """
    if model not in MODELS:
        raise ValueError(f"Unknown model {model!r}. Expected one of {MODELS}.")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1. Received: epochs={epochs}.")
    load_digits_split()  # fail early, in this process, if scikit-learn is missing
    runs = []
    for policy in policies or policies_to_run():
        print(f"training {model} under {policy} ...", file=sys.stderr, flush=True)
        data = _runs.in_fresh_process(
            "kmp.tools.demo:train_one",
            [model, policy, epochs],
            timeout,
            what=policy,
            show_output=True,
        )
        runs.append(
            DemoRun(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
            )
        )
    return runs


def plot(runs: Sequence[DemoRun], path: str, title: str) -> None:
    """Loss curves per policy, and the loss scale over steps."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    loss_ax, scale_ax = fig.subplots(1, 2)
    for r in runs:
        epochs = range(1, len(r.train_loss) + 1)
        line = loss_ax.plot(epochs, r.train_loss, label=f"{r.policy} train")[0]
        loss_ax.plot(
            epochs,
            r.val_loss,
            linestyle="--",
            color=line.get_color(),
            label=f"{r.policy} val",
        )
        if r.loss_scale:
            scale_ax.step(
                range(1, len(r.loss_scale) + 1),
                r.loss_scale,
                where="post",
                label=r.policy,
            )
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("loss")
    loss_ax.legend(fontsize=8)
    scale_ax.set_xlabel("step")
    scale_ax.set_ylabel("loss scale")
    if any(r.loss_scale for r in runs):
        scale_ax.set_yscale("log", base=2)
        scale_ax.legend(fontsize=8)
    else:
        scale_ax.text(
            0.5,
            0.5,
            "no policy used loss scaling",
            ha="center",
            va="center",
            transform=scale_ax.transAxes,
        )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
