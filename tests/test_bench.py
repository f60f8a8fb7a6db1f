import json
import math
import re
import sys

import keras
import pytest

import kmp_cli
from kmp.tools import bench
from kmp.tools import runs as _runs


@pytest.mark.slow
def test_bench_cli_prints_well_formed_json_for_each_policy(
    capsys, tmp_path, runs_in_this_process
):
    plot = tmp_path / "bench.png"
    code = kmp_cli.main(
        [
            "bench",
            "--model",
            "mlp",
            "--policies",
            "mixed_bfloat16",
            "--steps",
            "2",
            "--batch-size",
            "8",
            "--rounds",
            "1",
            "--keras",
            "--json",
            "--plot",
            str(plot),
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)
    assert [r["policy"] for r in rows] == ["mixed_bfloat16", "keras:mixed_bfloat16"]
    for r in rows:
        assert r["median_step_ms"] > 0 and r["samples_per_s"] > 0
        assert r["peak_host_rss_mb"] > 0 and len(r["step_ms"]) == 2
        assert r["skipped_steps"] >= 0  # counted for kmp and plain Keras
    # No float32 run: no speed-up; the kmp row is compared with plain Keras.
    assert all(r["speedup_vs_float32"] is None for r in rows)
    kmp_row, keras_row = rows
    want = keras_row["median_step_ms"] / kmp_row["median_step_ms"]
    assert kmp_row["kmp_vs_keras"] == pytest.approx(want, abs=2e-3)
    assert "[1/2] mlp under mixed_bfloat16" in captured.err  # progress
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_bench_runs_a_saved_text_model_with_its_own_layers(tmp_path):
    """keras-io's text Transformer (its own layer classes, token inputs)
    saved to a file: each run imports the module that registers them."""
    from benchmarks import keras_io_text_transformer as keras_io

    path = tmp_path / "text_transformer.keras"
    keras_io.keras_io_text_transformer(vocab_size=100, maxlen=16).save(path)
    results = bench.run(
        str(path),
        policies=("mixed_bfloat16",),
        steps=2,
        batch_size=8,
        rounds=1,
        imports=["benchmarks.keras_io_text_transformer"],
    )
    assert [r.policy for r in results] == ["mixed_bfloat16"]
    assert all(math.isfinite(r.final_loss) for r in results)


def test_bench_compares_each_policy_with_plain_keras_and_bounds_its_runs(
    monkeypatch,
):
    calls = []

    def fake_run(function, args, timeout, what, show_output):
        _, policy, steps, _, _, plain, budget, imports = args
        calls.append((what, budget, imports))
        ms = {"float32": 100.0, "mixed_bfloat16": 50.0}[policy] * (2 if plain else 1)
        return {
            "policy": what,
            "step_ms": [ms] * steps,
            "peak_host_rss_mb": 900.0,
            "peak_gpu_mb": None,
            "final_loss": 1.0,
            "skipped_steps": 0,
            "stopped_early": plain and policy == "mixed_bfloat16",
        }

    monkeypatch.setattr(bench._runs, "in_fresh_process", fake_run)
    results = {
        r.policy: r
        for r in bench.run(
            "mlp",
            policies=("float32", "mixed_bfloat16"),
            steps=3,
            rounds=1,
            compare_keras=True,
            keras_budget_s=30.0,
        )
    }
    # The budget bounds plain Keras's runs only.
    assert sorted(calls) == [
        ("float32", None, []),
        ("keras:float32", 30.0, []),
        ("keras:mixed_bfloat16", 30.0, []),
        ("mixed_bfloat16", None, []),
    ]
    # Speed-ups: kmp rows against kmp's float32, keras rows against Keras's.
    assert results["mixed_bfloat16"].speedup_vs_float32 == 2.0  # 100 / 50 ms
    assert results["keras:mixed_bfloat16"].speedup_vs_float32 == 2.0  # 200 / 100
    assert results["float32"].kmp_vs_keras == 2.0  # Keras 200 ms, kmp 100
    assert results["mixed_bfloat16"].kmp_vs_keras == 2.0
    assert results["keras:float32"].kmp_vs_keras is None
    assert results["keras:mixed_bfloat16"].stopped_early
    assert not results["mixed_bfloat16"].stopped_early


def test_a_run_over_its_budget_stops_after_two_steps():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.stop_training = False  # as fit sets it
    times = []
    timer = _runs.step_timer(times, budget_s=0.0)
    timer.set_model(model)
    for step in range(2):
        timer.on_train_batch_begin(step)
        timer.on_train_batch_end(step)
        # The first step (tracing) never stops a run on its own.
        assert model.stop_training == (step == 1)
    unbounded = _runs.step_timer([], budget_s=None)
    model.stop_training = False
    unbounded.set_model(model)
    for step in range(3):
        unbounded.on_train_batch_begin(step)
        unbounded.on_train_batch_end(step)
    assert not model.stop_training


def test_bench_table_is_printed(capsys, monkeypatch):
    fake = [
        bench.BenchResult("float32", 10.0, 1.0, 6400.0, 900.0, None, 0.5, 0, (10.0,)),
        bench.BenchResult(
            "mixed_bfloat16", 5.0, 2.0, 12800.0, 880.0, None, 0.51, 0, (5.0,)
        ),
    ]
    monkeypatch.setattr(bench, "run", lambda **kwargs: fake)
    assert kmp_cli.main(["bench"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("policy"))
    head, row = lines[header], lines[header + 3]  # the header, a rule, float32
    assert re.split(r"\s{2,}", head)[:3] == ["policy", "ms/step", "speed-up"]
    assert "loss (mean)" in head
    assert re.split(r"\s{2,}", row)[:3] == ["mixed_bfloat16", "5.0", "2.00x"]
    # A table: each column starts where its header does, in every row.
    for name, value in (("ms/step", "5.0"), ("speed-up", "2.00x")):
        assert row.index(value) == head.index(name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": "resnet1000"}, "Unknown model"),
        ({"policies": ("float32", "fp8")}, "Unknown policy 'fp8'"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"keras_budget_s": -5.0}, "keras_budget_s must be a positive number"),
    ],
)
def test_bench_rejects_bad_arguments_before_starting_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.run(**kwargs)


def test_gpu_script_refuses_clearly_without_a_gpu(tmp_path):
    import os
    import subprocess

    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU: gpu.sh would run the benchmark")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        ["bash", os.path.join(root, "benchmarks", "gpu.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable},
    )
    assert result.returncode == 3
    assert "needs TensorFlow with a visible GPU" in result.stderr


@pytest.mark.slow
def test_the_jax_gpu_script_runs_its_table_on_this_cpu_when_told(tmp_path):
    # benchmarks/gpu_jax.sh, as a GPU machine runs it, with CPU=1 and the
    # smallest settings: one model, one policy, one step, kmp alone.
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    settings = {"MODELS": "mlp", "POLICIES": "float32", "STEPS": "1", "BATCH": "4"}
    result = subprocess.run(
        ["bash", os.path.join(root, "benchmarks", "gpu_jax.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            **settings,
            "OUT": str(tmp_path),
            "PYTHON": sys.executable,
            "CPU": "1",
            "KERAS": "0",
        },
    )
    assert result.returncode == 0, result.stderr
    (row,) = json.loads((tmp_path / "mlp.float32.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "doctor.json",
        "mlp.float32.json",
    ]  # nothing else: a device returns this folder
    assert row["policy"] == "float32" and row["median_step_ms"] > 0
    assert "'keras backend': 'jax'" in result.stdout
    assert re.search(r"mlp +float32 +[0-9.]+ ms/step", result.stdout)


def test_a_ratio_against_a_stopped_plain_keras_run_is_marked_as_a_bound(
    capsys, monkeypatch
):
    fake = [
        bench.BenchResult(
            "mixed_float16", 50.0, 1.0, 1280.0, 900.0, None, 0.5, 0, (50.0,), 300.0
        ),
        bench.BenchResult(
            "keras:mixed_float16",
            15000.0,
            None,
            4.3,
            900.0,
            None,
            0.6,
            None,
            (15000.0,),
            None,
            True,
        ),
    ]
    monkeypatch.setattr(bench, "run", lambda **kwargs: fake)
    assert kmp_cli.main(["bench", "--keras", "--policies", "mixed_float16"]) == 0
    out = capsys.readouterr().out
    assert ">=300.00" in out
    assert "15000.0 (stopped early)" in out
    assert "stopped early: the run reached --keras-budget (120 s)" in out


def linear_memory(base_mb=100.0, per_sample_mb=3.0):
    """A stand-in for the runs: peak grows linearly with the batch."""
    tried = []

    def measure(batch):
        tried.append(batch)
        return base_mb + per_sample_mb * batch, 10.0 + batch

    return measure, tried


@pytest.mark.parametrize(
    "budget, start, expected",
    [
        (400, 64, 96),  # 96 -> 388 MB fits, 104 -> 412 does not
        (400, 8, 96),  # the same boundary, found upward from 8
        (130, 64, 8),  # downward: halving from 64
        (104, 64, 1),  # below BATCH_STEP every size counts
        (50, 64, None),  # not even a batch of 1
    ],
)
def test_the_largest_batch_within_a_budget_is_found(budget, start, expected):
    measure, tried = linear_memory()
    fit = bench.largest_batch("mlp", "float32", budget, start=start, measure=measure)
    assert fit.batch_size == expected
    assert [batch for batch, _ in fit.probes] == tried
    if expected is None:
        assert fit.peak_mb is None and tried[-1] == 1
        return
    assert fit.peak_mb == 100 + 3 * expected <= budget
    assert fit.median_step_ms == 10 + expected
    # The next size up was tried and did not fit: the answer is the largest.
    step = bench.BATCH_STEP if expected >= bench.BATCH_STEP else 1
    assert (expected + step, 100 + 3 * (expected + step)) in fit.probes
    assert 100 + 3 * (expected + step) > budget


def test_the_batch_search_stops_at_max_batch():
    measure, tried = linear_memory()
    fit = bench.largest_batch(
        "mlp", "float32", 10**6, start=64, max_batch=300, measure=measure
    )
    assert (fit.batch_size, tried) == (300, [64, 128, 256, 300])


def test_a_run_out_of_memory_does_not_fit_and_other_failures_are_raised():
    def measure(batch):
        if batch > 32:
            raise _runs.RunFailed("killed", -9, "")
        return 100.0, 5.0

    fit = bench.largest_batch("mlp", "float32", 1000, start=16, measure=measure)
    assert fit.batch_size == 32 and (64, None) in fit.probes

    def tensorflow_oom(batch):
        raise _runs.RunFailed("failed", 1, "tensorflow...ResourceExhaustedError: OOM")

    fit = bench.largest_batch("mlp", "float32", 1000, start=4, measure=tensorflow_oom)
    assert fit.batch_size is None

    def cpp_abort(batch):
        raise _runs.RunFailed("aborted", -6, "what():  std::bad_alloc")

    fit = bench.largest_batch("mlp", "float32", 1000, start=2, measure=cpp_abort)
    assert fit.batch_size is None and fit.probes == ((2, None), (1, None))

    def broken(batch):
        raise _runs.RunFailed("failed", 1, "ValueError: a bug in the model")

    with pytest.raises(_runs.RunFailed, match="failed"):
        bench.largest_batch("mlp", "float32", 1000, measure=broken)


@pytest.mark.parametrize("text", ["4", "G", "-1G", "0M", "four gigs", "4X"])
def test_a_memory_budget_without_a_size_and_unit_is_refused(text):
    with pytest.raises(ValueError, match="positive size with a unit"):
        bench.parse_memory(text)


def test_memory_sizes_are_read_in_mib():
    sizes = ["1.5GiB", "800MB", "2T", "512k"]
    assert [bench.parse_memory(t) for t in sizes] == [1536.0, 800.0, 2 * 1024.0**2, 0.5]


def test_bench_cli_finds_the_largest_batch_per_policy(capsys, runs_in_this_process):
    code = kmp_cli.main(
        [
            "bench", "--model", "mlp", "--policies", "float32,mixed_bfloat16",
            "--memory-budget", "1T", "--batch-size", "4", "--max-batch", "8",
            "--json",
        ]
    )  # fmt: skip
    assert code == 0
    fits = json.loads(capsys.readouterr().out)
    assert [f["policy"] for f in fits] == ["float32", "mixed_bfloat16"]
    for f in fits:
        assert f["batch_size"] == 8 and [p[0] for p in f["probes"]] == [4, 8]
        assert 0 < f["peak_mb"] <= f["budget_mb"] == 1024.0**2
        assert f["median_step_ms"] > 0
    assert kmp_cli.main(["bench", "--memory-budget", "lots"]) != 0
    assert "positive size with a unit" in capsys.readouterr().err


def test_a_plain_keras_run_that_fails_is_a_row_and_a_kmp_run_that_fails_raises(
    monkeypatch, capsys
):
    calls = []

    def fake_run(function, args, timeout, what, show_output):
        steps = args[2]
        calls.append(what)
        if what in ("keras:mixed_float16", "mixed_bfloat16"):
            raise bench._runs.RunFailed(
                f"The {what} run failed in its process",
                1,
                "Traceback ...\nValueError: The precision 'F16_F16_F32' is not "
                "supported by dot_general on CPU\n--------------------\n"
                "For simplicity, JAX has removed its internal frames.\n",
            )
        return {
            "policy": what,
            "step_ms": [10.0] * steps,
            "peak_host_rss_mb": 900.0,
            "peak_gpu_mb": None,
            "final_loss": 1.0,
            "skipped_steps": 0,
        }

    monkeypatch.setattr(bench._runs, "in_fresh_process", fake_run)
    results = {
        r.policy: r
        for r in bench.run(
            "mlp", policies=("mixed_float16",), steps=2, rounds=2, compare_keras=True
        )
    }
    failed = results["keras:mixed_float16"]
    assert failed.failed == (
        "ValueError: The precision 'F16_F16_F32' is not supported by dot_general on CPU"
    )
    assert results["mixed_float16"].kmp_vs_keras is None
    assert calls.count("keras:mixed_float16") == 1  # not run again
    rows = json.loads(bench.to_json(list(results.values())))  # strict JSON
    assert [r["median_step_ms"] for r in rows] == [10.0, None]
    with pytest.raises(bench._runs.RunFailed):  # kmp's own run failing
        bench.run("mlp", policies=("mixed_bfloat16",), steps=2, rounds=1)
    monkeypatch.setattr(bench, "run", lambda **kwargs: list(results.values()))
    assert kmp_cli.main(["bench", "--keras", "--policies", "mixed_float16"]) == 0
    out = capsys.readouterr().out
    assert "keras:mixed_float16 failed: ValueError: The precision" in out
