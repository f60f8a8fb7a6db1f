"""The `kmp` command line's commands. The only module that prints.

Its parser and entry point are in `kmp_cli`, which needs no TensorFlow (so
that `kmp --help` answers at once) and calls `run` here once a command is
parsed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kmp._base.table import format_table


def _cmd_policies(args: argparse.Namespace) -> int:
    from kmp.backend import machine
    from kmp.precision import policy as policy_lib

    rows = []
    for name in policy_lib.list_policies():
        if name == policy_lib.AUTO:
            continue
        p = policy_lib.get(name)
        scaling = "yes" if p.needs_loss_scaling else "no"
        rows.append((p.name, p.compute_dtype, p.variable_dtype, scaling))
    print(format_table(("name", "compute", "variables", "loss scaling"), rows))
    choice = machine.resolve_auto()
    print(f"\n'auto' on this machine: {choice.policy} ({choice.reason})")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    import json

    from kmp.diagnostics.doctor import doctor

    if not args.model:
        given = [
            flag
            for flag, value in (
                ("--policies", args.policies),
                ("--memory-budget", args.memory_budget),
                ("--import", args.imports),
                ("--sample", args.sample),
            )
            if value
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} only apply to a model's checks: pass "
                "--model FILE.keras with them."
            )
    report = doctor()
    if args.json:
        data = report.to_dict()
        if args.model:
            data["memory_estimate"] = _memory_estimates(args)
            data["activation_range"] = _activation_range(args)
        print(json.dumps(data, indent=2))
        return 0
    caps = report.capabilities
    yes = {True: "yes", False: "no"}
    print("kmp doctor\n")
    rows = [
        (
            "CPU",
            f"{caps.cpu.model} ({caps.cpu.cores} cores)",
            yes[caps.cpu.native_bfloat16],
            yes[caps.cpu.native_float16],
            ", ".join(sorted(caps.cpu.flags)) or "-",
        )
    ]
    for gpu in caps.gpus:
        cc = ".".join(map(str, gpu.compute_capability))
        rows.append(
            (
                "GPU",
                f"{gpu.name} (compute capability {cc})",
                yes[gpu.bfloat16_tensor_cores],
                yes[gpu.float16_tensor_cores],
                "TF32" if gpu.tf32 else "-",
            )
        )
    if caps.tpus:
        rows.append(("TPU", f"{caps.tpus} device(s)", "yes", "no", "-"))
    print(format_table(("device", "name", "bfloat16", "float16", "features"), rows))
    print(f"\n'auto' picks: {report.auto.policy}\n  because: {report.auto.reason}")
    print(f"\nfused update: {report.fused_update}")
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in report.versions.items()))
    if report.warnings:
        print("\nwarnings:")
        for warning in report.warnings:
            print(f"  - {warning}")
    if args.model:
        print()
        _memory_estimates(args)
        print()
        _activation_range(args)
    return 0


def _load_sample(path: str):
    """A sample batch from a .npy file (one input) or a .npz file (one
    array, or one per input name)."""
    import os

    import numpy as np

    if not (path.endswith((".npy", ".npz")) and os.path.exists(path)):
        raise ValueError(
            "--sample must be the path of an existing .npy file (one input) or "
            f".npz file (one array per input name). Received: {path!r}."
        )
    loaded = np.load(path, allow_pickle=False)
    if path.endswith(".npy"):
        return loaded
    arrays = dict(loaded)
    return next(iter(arrays.values())) if len(arrays) == 1 else arrays


def _activation_range(args: argparse.Namespace) -> list[dict]:
    """`kmp doctor --model FILE`: the layers whose activations, computed in
    float32 on a sample, reach float16's limit (or half of it), printed
    unless --json and returned."""
    import dataclasses

    import keras

    from kmp.backend import machine
    from kmp.diagnostics import audit
    from kmp.precision import policy as policy_lib
    from kmp.tools import bench

    model = keras.models.load_model(args.model, compile=False)  # its weights
    if args.sample:
        sample, where = _load_sample(args.sample), args.sample
    else:
        sample = bench.random_inputs(model, seed=0)(args.batch_size)[0]
        where = (
            f"random inputs at batch {args.batch_size} (pass --sample FILE.npy "
            "for real data: activations on random inputs can differ widely)"
        )
    risks, error = audit.range_check(model, sample)
    policy = machine.resolve_auto().policy
    checked = not error and policy_lib.get(policy).is_16bit
    if checked:
        # What the policy 'auto' picks here would do to the model's precision.
        lost, error = audit.precision_check(model, sample, policy)
        risks += lost
    if error:
        raise ValueError(
            f"kmp doctor could not run {args.model} on the sample: {error}."
        )
    found = [dataclasses.asdict(r) for r in risks]
    if not args.json:
        limit = audit.FLOAT16_MAX
        precision = (
            f"precision under {policy!r}, what 'auto' picks here"
            if checked
            else f"precision not checked: 'auto' picks {policy!r} here"
        )
        print(
            f"activation range and precision of {args.model} (one float32 "
            f"forward pass on {where}; float16's largest value is {limit:g}; "
            f"{precision}):"
        )
        if found:
            rows = [
                (r["layer"], r["class_name"], r["kind"], r["detail"]) for r in found
            ]
            print(format_table(("layer", "class", "risk", "detail"), rows))
            for kind in dict.fromkeys(r.kind for r in risks):
                fix = next(r.fix for r in risks if r.kind == kind)
                print(f"fix ({kind}): {fix}")
        else:
            lost = ", and none loses precision beyond rounding" if checked else ""
            print(f"  no layer reaches {limit / audit.DEFAULT_HEADROOM:g}{lost}.")
    return found


def _memory_estimates(args: argparse.Namespace) -> dict:
    """`kmp doctor --model FILE`: the memory estimate under each policy,
    printed (as text unless --json) and returned as a dict."""
    import importlib
    import os
    import warnings

    import keras

    import kmp
    from kmp.backend import live_tensors
    from kmp.backend import machine
    from kmp.diagnostics import memory
    from kmp.precision import policy as policy_lib
    from kmp.tools import bench

    if not (args.model.endswith(".keras") and os.path.exists(args.model)):
        raise ValueError(
            f"--model must be the path of an existing .keras file. Received: "
            f"{args.model!r}."
        )
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1. Received: {args.batch_size}.")
    budget = bench.parse_memory(args.memory_budget) if args.memory_budget else None
    for module in args.imports:
        importlib.import_module(module)
    names = (
        [p.strip() for p in args.policies.split(",") if p.strip()]
        if args.policies
        else list(dict.fromkeys(["float32", machine.resolve_auto().policy]))
    )
    for name in names:
        policy_lib.get(name)  # raises with the valid names, before any work
    with warnings.catch_warnings():
        # Only its optimizer's class and settings are read: an optimizer
        # saved before its first step has no state to load.
        warnings.simplefilter("ignore", UserWarning)
        optimizer = getattr(keras.models.load_model(args.model), "optimizer", None)
    results = {}
    for name in names:
        with kmp.policy_scope(name):
            model, make = bench._load_model(args.model, seed=0)
            try:
                estimate = memory.estimate_memory(
                    model, lambda n, make=make: make(n)[0], optimizer
                )
            except live_tensors.NoMemoryCount as e:
                # The same for every policy: said once; the other checks run.
                if not args.json:
                    print(f"memory estimate: not measured. {e}")
                return {name: {"error": str(e)} for name in names}
        results[name] = {
            **dataclasses.asdict(estimate),
            "batch_size": args.batch_size,
            "total_mb": estimate.total_mb(args.batch_size),
            "largest_batch": None if budget is None else estimate.largest_batch(budget),
        }
    if args.json:
        return results
    print(
        f"memory estimate for {args.model}: the peak of live tensors while "
        f"training at batch {args.batch_size} (TensorFlow's runtime not counted; "
        "the step measured by two small forward and backward passes)\n"
    )
    header = ["policy", "weights", "optimizer", "step", "per sample"]
    header += [f"total at {args.batch_size}"]
    header += [f"largest batch in {args.memory_budget}"] if budget else []
    rows = []
    for name, r in results.items():
        row = [
            name,
            _size(r["weights_mb"]),
            f"{_size(r['optimizer_mb'])} ({r['optimizer']})",
            _size(r["step_mb"]),
            _size(r["per_sample_mb"]),
            _size(r["total_mb"]),
        ]
        largest = "no bound" if r["largest_batch"] is None else str(r["largest_batch"])
        rows.append(row + ([largest] if budget else []))
    print(format_table(header, rows))
    uncounted = max(r["uncounted_below_mb"] for r in results.values())
    if uncounted:
        print(
            f"\nstep and per sample: TensorFlow's memory count here misses "
            f"tensors under {_size(uncounted)}, so these figures leave them out. "
            "They are lower bounds: a model whose tensors are all smaller shows "
            "its gradients as its step, and no growth per sample."
        )
    return results


def _size(mib: float) -> str:
    """A size given in MiB, in the unit that shows it: bytes under 1 KiB,
    then KiB, MiB and GiB (powers of 1024, as --memory-budget reads them),
    to one decimal ("644 B", "1.3 KiB", "256 KiB", "1.5 GiB")."""
    size, unit = mib * 2**20, "B"
    for larger in ("KiB", "MiB", "GiB"):
        if round(size, 0 if unit == "B" else 1) < 1024:
            break
        size, unit = size / 1024, larger
    if unit == "B":
        return f"{size:.0f} B"
    return f"{size:.1f}".removesuffix(".0") + f" {unit}"


def _cmd_bench(args: argparse.Namespace) -> int:
    from kmp.tools import bench

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.memory_budget:
        return _largest_batches(args, policies)
    results = bench.run(
        model=args.model,
        policies=policies,
        steps=args.steps,
        batch_size=args.batch_size,
        rounds=args.rounds,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        compare_keras=args.keras,
        keras_budget_s=args.keras_budget or None,
        imports=args.imports,
    )
    if args.plot:
        bench.plot(results, args.plot, title=f"kmp bench: {args.model}")
    if args.json:
        print(bench.to_json(results))
        return 0
    import keras  # for the backend's name, as the runs saw it

    gpu = any(r.peak_gpu_mb is not None for r in results)
    header = ["policy", "ms/step", "speed-up", "samples/s", "peak RSS MB"]
    header += ["peak GPU MB"] if gpu else ["tensors MB"]
    header += ["loss (mean)", "skipped"]
    compared = any(r.kmp_vs_keras is not None for r in results)
    by_policy = {r.policy: r for r in results}
    header += ["kmp/Keras"] if compared else []
    rows = []
    for r in results:
        if r.failed:
            rows.append([r.policy, "failed", *[""] * (len(header) - 2)])
            continue
        row = [
            r.policy,
            f"{r.median_step_ms:.1f}",
            "-" if r.speedup_vs_float32 is None else f"{r.speedup_vs_float32:.2f}x",
            f"{r.samples_per_s:.0f}",
            f"{r.peak_host_rss_mb:.0f}",
        ]
        row += [f"{r.peak_gpu_mb:.0f}"] if gpu else [_mb(r.peak_tensors_mb)]
        skipped = "-" if r.skipped_steps is None else str(r.skipped_steps)
        row += [f"{r.final_loss:.4f}", skipped]
        if compared:
            keras_row = by_policy.get(f"keras:{r.policy}")
            bound = ">=" if keras_row is not None and keras_row.stopped_early else ""
            row += ["-" if r.kmp_vs_keras is None else f"{bound}{r.kmp_vs_keras:.2f}"]
        if r.stopped_early:
            row[1] += " (stopped early)"
        rows.append(row)
    print(
        f"kmp bench: {args.model}, batch {args.batch_size}, {args.steps} timed "
        f"steps x {args.rounds} rounds, medians, Keras's "
        f"{keras.backend.backend()} backend\n"
    )
    print(format_table(header, rows))
    for r in results:
        if r.failed:
            print(f"\n{r.policy} failed: {r.failed}")
    if compared:
        print(
            "\nkmp/Keras: plain Keras's step time over kmp's under the same "
            "policy (above 1: kmp is faster)."
        )
    if any(r.stopped_early for r in results):
        print(
            f"stopped early: the run reached --keras-budget ({args.keras_budget:g} "
            "s); its figure is from its steps after the warm-up (after the "
            "first when it stopped at two), and a kmp/Keras ratio against it "
            "is marked with >=."
        )
    if args.plot:
        print(f"\nplot: {args.plot}")
    return 0


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _largest_batches(args: argparse.Namespace, policies: list[str]) -> int:
    """`kmp bench --memory-budget`: the largest batch per policy."""
    from kmp.precision import policy as policy_lib
    from kmp.tools import bench

    budget = bench.parse_memory(args.memory_budget)
    for name in policies:
        policy_lib.get(name)  # raises with the valid names, before any run
    fits = [
        bench.largest_batch(
            args.model,
            name,
            budget,
            start=args.batch_size,
            max_batch=args.max_batch,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
            imports=args.imports,
        )
        for name in policies
    ]
    if args.json:
        print(json.dumps([dataclasses.asdict(fit) for fit in fits], indent=2))
        return 0
    header = ["policy", "largest batch", "peak MB", "ms/step", "samples/s"]
    rows = []
    for fit in fits:
        if fit.batch_size is None:
            rows.append([fit.policy, "none fits", "-", "-", "-"])
            continue
        at_max = " (--max-batch)" if fit.batch_size == args.max_batch else ""
        rows.append(
            [
                fit.policy,
                f"{fit.batch_size}{at_max}",
                f"{fit.peak_mb:.0f}",
                f"{fit.median_step_ms:.1f}",
                f"{1000 * fit.batch_size / fit.median_step_ms:.0f}",
            ]
        )
    print(
        f"kmp bench: {args.model}, the largest batch within {args.memory_budget} "
        f"({budget:.0f} MB) of peak memory, per policy (batch sizes tried: "
        f"multiples of {bench.BATCH_STEP}, 2 steps each)\n"
    )
    print(format_table(header, rows))
    return 0


def _epochs(n: int) -> str:
    return f"{n} epoch" if n == 1 else f"{n} epochs"


def _cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses
    import json
    import os

    from kmp.backend import machine
    from kmp.diagnostics import doctor
    from kmp.tools import demo

    runs = demo.run(model=args.model, epochs=args.epochs)
    base = next(r for r in runs if r.policy == "float32")
    plot_path = os.path.abspath(args.plot)
    demo.plot(runs, plot_path, f"kmp demo: {args.model} on scikit-learn digits")
    close = all(abs(r.val_accuracy - base.val_accuracy) <= 0.01 for r in runs)
    converged = args.epochs >= demo.CONVERGED_EPOCHS
    floor = demo.learned_floor(converged, base.val_accuracy)
    learned = all(r.val_accuracy >= floor for r in runs)
    if args.json:
        print(
            json.dumps(
                {
                    "model": args.model,
                    "epochs": args.epochs,
                    "runs": [dataclasses.asdict(r) for r in runs],
                    "accuracy_within_1_point_of_float32": close,
                    "well_above_chance": learned,
                    "converged": converged,
                    "fast_path": doctor.fast_path(machine.capabilities()),
                    "plot": plot_path,
                },
                indent=2,
            )
        )
        return 0 if learned and (close or not converged) else 1
    rows = []
    for r in runs:
        scale = (
            "-"
            if r.loss_scale_min is None
            else f"{r.loss_scale_min:g} .. {r.loss_scale_max:g}"
        )
        rows.append(
            (
                r.policy,
                f"{r.median_step_ms:.2f}",
                f"{base.median_step_ms / r.median_step_ms:.2f}x",
                f"{r.peak_host_rss_mb:.0f}",
                _mb(r.peak_tensors_mb),
                f"{100 * r.val_accuracy:.1f}%",
                scale,
                str(r.skipped_steps),
            )
        )
    print(
        f"\nkmp demo: a {args.model} on scikit-learn's handwritten digits "
        f"(1,797 8x8 images; 20% held out), {_epochs(args.epochs)} per policy\n"
    )
    print(
        format_table(
            (
                "policy",
                "ms/step",
                "speed-up",
                "peak RSS MB",
                "tensors MB",
                "val accuracy",
                "loss scale",
                "skipped",
            ),
            rows,
        )
    )
    print(f"\n{doctor.fast_path(machine.capabilities())}")
    print(f"\nloss curves and loss scale: {plot_path}")
    if not learned:
        print(
            f"WARNING: a policy did not learn (accuracy under {100 * floor:.0f}% "
            f"after {_epochs(args.epochs)}; chance is {100 * demo.CHANCE:.0f}%): "
            "that is a bug, please report it with this output."
        )
        return 1
    if not converged:
        print(
            f"{_epochs(args.epochs)}: the models have not converged yet, so the "
            f"1-point accuracy check needs --epochs {demo.CONVERGED_EPOCHS} or more."
        )
        return 0
    if close:
        print(
            "every policy is within 1 point of float32's accuracy "
            f"({100 * base.val_accuracy:.1f}%); chance is 10%."
        )
        return 0
    print(
        "WARNING: a policy is more than 1 point from float32's accuracy; "
        "that is a bug: please report it with this output."
    )
    return 1


def _cmd_finetune(args: argparse.Namespace) -> int:
    from kmp.tools.finetune import run

    return run.finetune(args.finetune, dry_run=args.dry_run)


_COMMANDS = {
    "policies": _cmd_policies,
    "doctor": _cmd_doctor,
    "bench": _cmd_bench,
    "demo": _cmd_demo,
    "finetune": _cmd_finetune,
}


def run(args: argparse.Namespace) -> int:
    """Runs the command `kmp_cli.build_parser()` parsed into `args`."""
    return _COMMANDS[args.command](args)
