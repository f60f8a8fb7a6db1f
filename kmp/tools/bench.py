"""`kmp bench`: the same model under several policies, side by side.

Each (policy, round) runs in a fresh Python process, so that one policy's
graph settings, caches and memory never leak into another's; rounds
alternate the order of the policies, so that drift on a shared machine hits
all alike. This module measures and returns data; `kmp.tools.cli` prints it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

from kmp.tools import runs as _runs

BUILTIN_MODELS = ("mlp", "cnn", "transformer")
WARMUP_STEPS = 2


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """One policy's figures, over all its rounds."""

    policy: str
    median_step_ms: float
    speedup_vs_float32: float | None
    samples_per_s: float
    peak_host_rss_mb: float
    peak_gpu_mb: float | None
    final_loss: float  # the loss Keras reports after the run (its mean)
    skipped_steps: int | None  # None: not counted (plain Keras)
    step_ms: tuple[float, ...]  # every timed step, all rounds
    # Plain Keras's step time over kmp's, same policy (kmp rows, with
    # compare_keras): above 1, kmp is faster.
    kmp_vs_keras: float | None = None
    # Whether a run was stopped at its time budget (its figure is then from
    # fewer steps, possibly from before the warm-up ended).
    stopped_early: bool = False
    # The peak of live tensors (`kmp.tools.runs.tensors_peak_mb`): memory
    # above the runtime's own. None where TensorFlow keeps no count.
    peak_tensors_mb: float | None = None
    # Why a plain-Keras run failed (its error's last line), where it did:
    # its figures are then NaN.
    failed: str = ""


def build_model(name: str, seed: int = 0):
    """A built-in benchmark model and a matching synthetic data maker.

    Returns:
        (model, make_batch) where make_batch(n) returns (x, y) arrays.
    """
    import keras
    import numpy as np

    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    layers = keras.layers
    if name == "mlp":  # 3 x Dense(2048)
        model = keras.Sequential(
            [keras.Input((2048,))]
            + [layers.Dense(2048, activation="relu") for _ in range(3)]
            + [layers.Dense(10)]
        )

        def make(n):
            return rng.normal(size=(n, 2048)).astype("float32"), rng.integers(0, 10, n)

    elif name == "cnn":  # a small ResNet-like CNN on 32x32x3
        inputs = keras.Input((32, 32, 3))
        x = layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
        for filters in (32, 64, 128):
            shortcut = layers.Conv2D(filters, 1, strides=2)(x)
            y = layers.Conv2D(filters, 3, strides=2, padding="same")(x)
            y = layers.BatchNormalization()(y)
            y = layers.ReLU()(y)
            y = layers.Conv2D(filters, 3, padding="same")(y)
            y = layers.BatchNormalization()(y)
            x = layers.ReLU()(layers.Add()([y, shortcut]))
        x = layers.GlobalAveragePooling2D()(x)
        model = keras.Model(inputs, layers.Dense(10)(x))

        def make(n):
            return rng.random((n, 32, 32, 3), dtype="float32"), rng.integers(0, 10, n)

    elif name == "transformer":  # 2 encoder blocks, d=256, sequence 128
        tokens = keras.Input((128,), dtype="int32")
        x = layers.Embedding(8000, 256)(tokens)
        for _ in range(2):
            attention = layers.MultiHeadAttention(8, 32)(x, x)
            x = layers.LayerNormalization()(x + attention)
            ffn = layers.Dense(1024, activation="relu")(x)
            x = layers.LayerNormalization()(x + layers.Dense(256)(ffn))
        x = layers.GlobalAveragePooling1D()(x)
        model = keras.Model(tokens, layers.Dense(10)(x))

        def make(n):
            return rng.integers(0, 8000, (n, 128)), rng.integers(0, 10, n)

    else:
        raise ValueError(
            f"Unknown model {name!r}. Expected one of {', '.join(BUILTIN_MODELS)} "
            "or the path of a .keras file."
        )
    return model, make


def _load_model(path: str, seed: int):
    """A saved model rebuilt under the current policy (its saved dtypes are
    dropped), with random data of its input shape."""
    import keras

    # Read under float32: a layer that builds sublayers in its constructor
    # gives them the global policy, which would clash with its saved dtype.
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float32")
    try:
        saved = keras.models.load_model(path, compile=False)
        config = saved.get_config()
    finally:
        keras.config.set_dtype_policy(policy)

    def drop_dtypes(layers):
        # Layers then take the policy in force; inputs keep their dtypes.
        for layer in layers:
            layer_config = layer.get("config", {})
            if layer.get("class_name") != "InputLayer":
                layer_config.pop("dtype", None)
            drop_dtypes(layer_config.get("layers", []))

    drop_dtypes(config.get("layers", []))
    model = saved.__class__.from_config(config)
    return model, random_inputs(model, seed)


def random_inputs(model, seed: int):
    """`make(n)`: `n` random samples of `model`'s first input (token ids
    every Embedding accepts for a text model, else normal values) and
    targets of its first output's width."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(model.inputs[0].shape[1:])
    out_units = model.outputs[0].shape[-1]
    vocabulary = _token_range(model)

    def make(n):
        if vocabulary:  # a text model: token ids every Embedding accepts
            x = rng.integers(0, vocabulary, (n, *shape))
        else:
            x = rng.normal(size=(n, *shape)).astype("float32")
        return x, rng.normal(size=(n, out_units)).astype("float32")

    return make


def _token_range(model) -> int | None:
    """For a model with Embedding layers: the smallest vocabulary among
    them (ids below it are valid for each), else None."""
    import keras

    from kmp.internals import keras_private

    sizes = [
        layer.input_dim
        for layer in keras_private.sublayers(model)
        if isinstance(layer, keras.layers.Embedding)
    ]
    return min(sizes) if sizes else None


def run_one(
    model: str,
    policy: str,
    steps: int,
    batch_size: int,
    seed: int,
    plain_keras: bool = False,
    budget_s: float | None = None,
    imports: Sequence[str] = (),
) -> dict:
    """Trains `model` under `policy` for `steps` timed steps in this process
    and returns its figures (called in a fresh process by `run`).

    With `plain_keras`, the same run without kmp: Keras's own global dtype
    policy and `model.compile` (which wraps the optimizer in Keras's own
    loss-scale optimizer under mixed_float16), for comparison. With
    `budget_s`, the run stops once its steps have taken that long (two
    steps at least), and its figure comes from the steps after the warm-up
    (after the first when it stopped at two).
    `imports` are modules imported first (those that register a saved
    model's own layer classes)."""
    import importlib

    import keras

    import kmp
    from kmp.backend import machine
    from kmp.precision import policy as policy_lib

    for module in imports:
        importlib.import_module(module)
    if plain_keras:
        keras.config.set_dtype_policy(policy_lib.get(policy).keras_name)
    else:
        kmp.set_policy(policy)
    if model in BUILTIN_MODELS:
        net, make = build_model(model, seed)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        net, make = _load_model(model, seed)
        loss = "mse"
    if plain_keras:
        net.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    else:
        kmp.compile(net, optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    x, y = make((steps + WARMUP_STEPS) * batch_size)

    times: list[float] = []
    history = net.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=1,
        verbose=0,
        shuffle=False,
        callbacks=[_runs.step_timer(times, budget_s)],
    )
    stopped_early = len(times) < steps + WARMUP_STEPS
    timed = times[WARMUP_STEPS:] if len(times) > WARMUP_STEPS else times[1:]
    gpu_peak = machine.tensors_peak_mb(gpu_only=True)
    skipped = getattr(net.optimizer, "skipped_steps_total", None)
    if skipped is not None:
        skipped = int(keras.ops.convert_to_numpy(skipped))
    elif not isinstance(net.optimizer, keras.optimizers.LossScaleOptimizer):
        skipped = 0  # no loss scaling: nothing is ever skipped
    return {
        "policy": f"keras:{policy}" if plain_keras else policy,
        "step_ms": [1000 * t for t in timed],
        "peak_host_rss_mb": _runs.process_peak_mb(),
        "peak_gpu_mb": gpu_peak,
        "peak_tensors_mb": _runs.tensors_peak_mb(),
        "final_loss": float(history.history["loss"][-1]),
        # None: Keras's own loss-scale wrapper keeps no count of skips.
        "skipped_steps": skipped,
        "stopped_early": stopped_early,
    }


def run(
    model: str = "mlp",
    policies: Sequence[str] = ("float32", "mixed_bfloat16", "mixed_float16"),
    steps: int = 20,
    batch_size: int = 64,
    rounds: int = 2,
    seed: int = 0,
    timeout: float = 900,
    progress: Callable[[str], None] | None = None,
    compare_keras: bool = False,
    keras_budget_s: float | None = 120.0,
    imports: Sequence[str] = (),
) -> list[BenchResult]:
    """Benchmarks `model` under each policy; returns one `BenchResult` each.

    Args:
        model: `'mlp'`, `'cnn'`, `'transformer'` or a `.keras` file.
        policies: Policy names; `'float32'` is the speed-up baseline.
        steps: Timed train steps per run (after 2 warm-up steps).
        batch_size: Samples per step.
        rounds: Runs per policy, each in a fresh process, order alternating.
        seed: Seed of the weights and the synthetic data.
        timeout: Seconds allowed for one run.
        progress: Called with a line of text before each run.
        compare_keras: Also run each policy with plain Keras (no kmp), as
            `keras:<policy>` rows, interleaved with the kmp runs.
        keras_budget_s: Seconds one plain-Keras run may train before it is
            stopped (`None`: no limit). Plain Keras's float16 takes minutes
            per step on some CPUs; such a row is marked `stopped_early`.
        imports: Modules each run imports before loading a `.keras` file:
            those that register its own layer classes
            (`@keras.saving.register_keras_serializable`). Text models
            (with `Embedding` layers) get token ids as inputs.

    Raises:
        ValueError: for an unknown model or policy, or non-positive counts.
    """
    from kmp.precision import policy as policy_lib

    if model not in BUILTIN_MODELS and not (
        model.endswith(".keras") and os.path.exists(model)
    ):
        raise ValueError(
            f"Unknown model {model!r}. Expected one of {', '.join(BUILTIN_MODELS)} "
            "or the path of an existing .keras file."
        )
    for name in policies:
        policy_lib.get(name)  # raises with the valid names
    for name, value in (
        ("steps", steps),
        ("batch_size", batch_size),
        ("rounds", rounds),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1. Received: {name}={value}.")
    if keras_budget_s is not None and not keras_budget_s > 0:
        raise ValueError(
            "keras_budget_s must be a positive number of seconds, or None for "
            f"no limit. Received: keras_budget_s={keras_budget_s}."
        )
    variants = [(p, False) for p in policies]
    if compare_keras:
        variants += [(p, True) for p in policies]
    runs: dict[str, list[dict]] = {
        (f"keras:{p}" if keras else p): [] for p, keras in variants
    }
    failures: dict[str, str] = {}
    total = rounds * len(variants)
    done = 0
    for r in range(rounds):
        for name, keras in variants if r % 2 == 0 else variants[::-1]:
            done += 1
            label = f"keras:{name}" if keras else name
            if label in failures:
                continue  # failed once: not run again
            if progress:
                progress(f"[{done}/{total}] {model} under {label} (round {r + 1})")
            try:
                figures = _runs.in_fresh_process(
                    "kmp.tools.bench:run_one",
                    [
                        model,
                        name,
                        steps,
                        batch_size,
                        seed,
                        keras,
                        keras_budget_s if keras else None,
                        list(imports),
                    ],
                    timeout,
                    what=label,
                    show_output=False,
                )
            except _runs.RunFailed as e:
                if not keras:
                    raise
                # Plain Keras failing where kmp trains is a finding: kept.
                failures[label] = _last_line(e.stderr) or str(e)
                continue
            runs[label].append(figures)

    def median_of(label):
        if label not in runs or not runs[label]:
            return None
        return statistics.median(t for run_ in runs[label] for t in run_["step_ms"])

    results = []
    for name, name_runs in runs.items():
        if name in failures:
            results.append(_failed(name, failures[name]))
            continue
        step_ms = tuple(t for run_ in name_runs for t in run_["step_ms"])
        median = statistics.median(step_ms)
        # kmp rows against kmp's float32; keras: rows against Keras's float32.
        baseline = median_of(
            "keras:float32" if name.startswith("keras:") else "float32"
        )
        results.append(
            BenchResult(
                policy=name,
                median_step_ms=round(median, 2),
                speedup_vs_float32=round(baseline / median, 3) if baseline else None,
                samples_per_s=round(1000 * batch_size / median, 1),
                peak_host_rss_mb=round(
                    max(r["peak_host_rss_mb"] for r in name_runs), 1
                ),
                peak_gpu_mb=(
                    None
                    if name_runs[0]["peak_gpu_mb"] is None
                    else round(max(r["peak_gpu_mb"] for r in name_runs), 1)
                ),
                final_loss=round(
                    statistics.median(r["final_loss"] for r in name_runs), 4
                ),
                skipped_steps=(
                    None
                    if name_runs[0]["skipped_steps"] is None
                    else max(r["skipped_steps"] for r in name_runs)
                ),
                step_ms=step_ms,
                kmp_vs_keras=(
                    None
                    if name.startswith("keras:") or median_of(f"keras:{name}") is None
                    else round(median_of(f"keras:{name}") / median, 3)
                ),
                stopped_early=any(r.get("stopped_early") for r in name_runs),
                peak_tensors_mb=_max_or_none(
                    r.get("peak_tensors_mb") for r in name_runs
                ),
            )
        )
    return results


def _last_line(text: str) -> str:
    """The last line of a child's stderr that is not blank or JAX's note."""
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not set(line.strip()) <= {"-"}
    ]
    lines = [line for line in lines if not line.startswith("For simplicity, JAX")]
    return lines[-1] if lines else ""


def _failed(policy: str, why: str) -> BenchResult:
    """The row of a plain-Keras run that failed."""
    nan = float("nan")
    return BenchResult(
        policy=policy,
        median_step_ms=nan,
        speedup_vs_float32=None,
        samples_per_s=nan,
        peak_host_rss_mb=nan,
        peak_gpu_mb=None,
        final_loss=nan,
        skipped_steps=None,
        step_ms=(),
        failed=why,
    )


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """The largest batch size of one policy that trained within a budget."""

    policy: str
    budget_mb: float
    batch_size: int | None  # None: not even a batch of 1 fitted
    peak_mb: float | None  # that batch's measured peak
    median_step_ms: float | None  # and its step time
    # Every batch size tried, in order, with its peak (None: it ran out of
    # memory in its process).
    probes: tuple[tuple[int, float | None], ...]


# Batch sizes the search tries are multiples of this (below it, any size).
BATCH_STEP = 8


def parse_memory(text: str) -> float:
    """A memory size such as `'4G'`, `'512M'`, `'1.5GiB'` or `'800MB'`, in
    MiB (K, M, G and T are powers of 1024, with or without `iB`/`B`).

    Example:

    >>> kmp.tools.bench.parse_memory("4G"), kmp.tools.bench.parse_memory("512M")
    (4096.0, 512.0)
    """
    units = {"K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0**2}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        size = float(value[:-1]) * units[value[-1]] if value else -1.0
    except (KeyError, ValueError):
        size = -1.0
    if not size > 0:
        raise ValueError(
            f"A memory budget must be a positive size with a unit, such as "
            f"'4G', '512M' or '1.5GiB'. Received: {text!r}."
        )
    return size


def largest_batch(
    model: str,
    policy: str,
    budget_mb: float,
    start: int = 64,
    max_batch: int = 1 << 16,
    steps: int = 2,
    seed: int = 0,
    timeout: float = 900,
    progress: Callable[[str], None] | None = None,
    imports: Sequence[str] = (),
    measure: Callable[[int], tuple[float, float]] | None = None,
) -> BatchFit:
    """The largest batch size with which `model` trains under `policy` with
    a peak memory within `budget_mb`, found by measurement: each batch size
    tried trains `steps` steps (after the warm-up) in a fresh process.

    The peak is the process's resident memory (`ru_maxrss`: TensorFlow's
    runtime included, as the machine's memory limit counts it), or the
    GPU's peak where there is a GPU. From `start`, the batch doubles while
    it fits (halves while it does not), then a bisection over multiples of
    `BATCH_STEP` finds the boundary. A run that dies out of memory (killed,
    or TensorFlow's `ResourceExhaustedError`) does not fit; any other
    failure is raised.

    Args:
        model, policy, steps, seed, timeout, imports: As for `run`.
        budget_mb: The budget in MiB (`parse_memory` reads `'4G'`).
        start: The first batch size tried.
        max_batch: The largest batch size tried.
        progress: Called with a line of text before each run.
        measure: `batch -> (peak MiB, median ms/step)` in place of the runs
            (for tests).
    """
    if not budget_mb > 0:
        raise ValueError(f"budget_mb must be positive. Received: {budget_mb}.")
    for name, value in (("start", start), ("max_batch", max_batch), ("steps", steps)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1. Received: {name}={value}.")
    if measure is None:

        def measure(batch):
            result = _runs.in_fresh_process(
                "kmp.tools.bench:run_one",
                [model, policy, steps, batch, seed, False, None, list(imports)],
                timeout,
                what=f"{policy} at batch {batch}",
                show_output=False,
            )
            peak = result["peak_gpu_mb"] or result["peak_host_rss_mb"]
            return peak, statistics.median(result["step_ms"])

    probes: list[tuple[int, float | None]] = []
    fits: dict[int, tuple[float, float]] = {}

    def fit(batch):
        if progress:
            progress(f"{model} under {policy} at batch {batch}")
        try:
            peak, ms = measure(batch)
        except _runs.RunFailed as e:
            if not e.out_of_memory:
                raise
            probes.append((batch, None))
            return False
        probes.append((batch, round(peak, 1)))
        if peak <= budget_mb:
            fits[batch] = (peak, ms)
            return True
        return False

    batch = min(start, max_batch)
    if fit(batch):
        low, high = batch, None
        while high is None and low < max_batch:
            batch = min(2 * low, max_batch)
            if fit(batch):
                low = batch
            else:
                high = batch
    else:
        low, high = None, batch
        while low is None and high > 1:
            batch = high // 2
            if fit(batch):
                low = batch
            else:
                high = batch
    if low is None:
        return BatchFit(policy, budget_mb, None, None, None, tuple(probes))
    step = BATCH_STEP if low >= BATCH_STEP else 1
    while high is not None and high - low > step:
        batch = (low + high) // 2 // step * step
        if batch <= low:
            break
        if fit(batch):
            low = batch
        else:
            high = batch
    peak, ms = fits[low]
    return BatchFit(policy, budget_mb, low, round(peak, 1), round(ms, 2), tuple(probes))


def _max_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(max(values), 1) if values else None


def plot(results: Sequence[BenchResult], path: str, title: str = "") -> None:
    """Writes a PNG: speed-up and peak memory per policy."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.0, 4.0), dpi=100)
    FigureCanvasAgg(fig)
    speed_ax, memory_ax = fig.subplots(1, 2)
    results = [r for r in results if not r.failed]
    names = [r.policy for r in results]
    speed_ax.bar(
        names, [r.speedup_vs_float32 or 0.0 for r in results], color="tab:blue"
    )
    speed_ax.axhline(1.0, color="gray", linewidth=1)
    speed_ax.set_ylabel("speed-up vs float32")
    memory_ax.bar(
        names,
        [r.peak_gpu_mb or r.peak_host_rss_mb for r in results],
        color="tab:orange",
    )
    memory_ax.set_ylabel("peak memory (MB)")
    for ax in (speed_ax, memory_ax):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title or "kmp bench")
    fig.tight_layout()
    fig.savefig(path)


def to_json(results: Sequence[BenchResult]) -> str:
    rows: list[dict[str, Any]] = []
    for r in results:
        row = dataclasses.asdict(r)
        row["step_ms"] = [round(t, 3) for t in r.step_ms]
        if r.failed:  # its figures are NaN, which JSON cannot hold
            row = {k: None if v != v else v for k, v in row.items()}
        rows.append(row)
    return json.dumps(rows, indent=2)
