import json
import re

import pytest

import kmp_cli
from kmp.tools import demo

# A machine's one line on its fast path (its wording per machine is tested
# against fake machines in test_doctor.py).
FAST_PATH_LINE = re.compile(r"^(Fast path: |No fast 16-bit path: )\S.*\.$", re.M)


@pytest.mark.slow
def test_demo_trains_each_policy_to_float32_accuracy(
    capsys, tmp_path, runs_in_this_process
):
    plot = tmp_path / "demo.png"
    # The fewest epochs that count as converged, on the small CNN: the same
    # runs, the same 1-point claim, a third of the default MLP's time (the
    # default's converged accuracy is `kmp demo`'s own output, `make demo`).
    epochs = str(demo.CONVERGED_EPOCHS)
    argv = ["demo", "--json", "--model", "cnn", "--epochs", epochs]
    assert kmp_cli.main([*argv, "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "cnn"
    assert FAST_PATH_LINE.fullmatch(report["fast_path"])
    runs = {r["policy"]: r for r in report["runs"]}
    assert "float32" in runs and "mixed_float16" in runs
    assert report["accuracy_within_1_point_of_float32"] is True
    for r in runs.values():
        assert r["val_accuracy"] > 0.9  # chance is 0.1
        assert abs(r["val_accuracy"] - runs["float32"]["val_accuracy"]) <= 0.01
    scaled = runs["mixed_float16"]
    assert scaled["loss_scale_min"] >= 1 and len(scaled["loss_scale"]) > 0
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_demo_table_with_the_transformer(capfd, tmp_path, runs_in_this_process):
    # Each policy runs in this process; a run's own process, and that it
    # prints no TensorFlow start-up or later notices, is tested through the
    # demo's call in test_cli (the filter's notices in its unit tests).
    code = kmp_cli.main(
        [
            "demo",
            "--model",
            "transformer",
            "--epochs",
            "1",
            "--plot",
            str(tmp_path / "t.png"),
        ]
    )
    captured = capfd.readouterr()
    out = captured.out
    assert code == 0
    assert "epoch 1/1" in captured.err  # each run's progress
    # One epoch: no 1-point claim, and no "did not learn" alarm for a model
    # that is still far from its accuracy under every policy (it exited 1).
    assert "have not converged yet" in out
    assert "did not learn" not in out
    # One line says what a speed-up comes from on this machine.
    assert FAST_PATH_LINE.search(out)
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    columns = header.split()
    assert columns.index("ms/step") < columns.index("speed-up")
    assert "float32" in out and "mixed_float16" in out
    assert f"loss curves and loss scale: {tmp_path / 't.png'}" in out


def _runs_reaching(accuracies: dict) -> list:
    return [
        demo.DemoRun(
            policy=policy,
            median_step_ms=1.0,
            peak_host_rss_mb=1.0,
            val_accuracy=accuracy,
            loss_scale_min=None,
            loss_scale_max=None,
            skipped_steps=0,
            train_loss=(1.0,),
            val_loss=(1.0,),
            loss_scale=(),
        )
        for policy, accuracy in accuracies.items()
    ]


@pytest.mark.parametrize(
    "epochs, mixed, code, said",
    [
        # Not converged: a model still far from its accuracy is no bug...
        (1, 0.44, 0, "have not converged yet"),
        # ...but a run at chance is, converged or not, and so is one far
        # behind float32's (here at 43%) before convergence.
        (1, 0.10, 1, "did not learn (accuracy under 22% after 1 epoch;"),
        (1, 0.20, 1, "did not learn (accuracy under 22% after 1 epoch;"),
        (8, 0.43, 1, "did not learn (accuracy under 50% after 8 epochs;"),
    ],
)
def test_the_demo_calls_a_run_that_did_not_learn_a_bug(
    monkeypatch, capsys, tmp_path, epochs, mixed, code, said
):
    runs = _runs_reaching({"float32": 0.43, "mixed_float16": mixed})
    monkeypatch.setattr(demo, "run", lambda model, epochs: runs)
    plot = str(tmp_path / "p.png")
    argv = ["demo", "--model", "cnn", "--epochs", str(epochs), "--plot", plot]
    assert kmp_cli.main(argv) == code
    assert said in capsys.readouterr().out


def test_demo_policies_are_float32_auto_and_float16():
    policies = demo.policies_to_run()
    assert policies[0] == "float32" and "mixed_float16" in policies
    assert len(policies) == len(set(policies))


def test_demo_cli_reports_bad_arguments_in_one_line(capsys):
    assert kmp_cli.main(["demo", "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kmp demo: epochs must be >= 1. Received: epochs=0."
    )


def test_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Unknown model"):
        demo.run(model="resnet")
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        demo.run(epochs=0)
