"""The table ms-swift prints in its scripts' headers, measured: `kmp
finetune` on a small KerasHub Llama and Gemma (random weights that learned
a base task, made here), per method and policy.

Methods: full fine-tuning, LoRA (rank 8 / alpha 32 on every linear layer),
QLoRA with an int8 base and with an int4 base, and full fine-tuning with
Keras's float8 training. Policies: 'auto' and mixed_float16 (Keras refuses
int8 under float16: that row says so).

Each run is `kmp finetune` in a fresh process, on the synthetic
instruction task of examples/finetune_data.py. From its metrics.json: the
process's peak resident memory (TensorFlow's runtime included), the peak
of live tensors and kmp's estimate of it, tokens per second (the median
of the progress lines after the first), the last training loss and the
held-out accuracy of the response tokens (chance: 1 in 26).

Run: python benchmarks/finetune_table.py [--hidden 512] [--layers 4]
     [--epochs 2] [--archs llama gemma] [--methods full LoRA ...]
     [--out /tmp/finetune-table]
"""

import argparse
import json
import os
import pathlib
import runpy
import statistics
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = pathlib.Path(__file__).resolve().parent.parent
METHODS = {
    "full": ["--method", "full", "--quantize", "null"],
    "LoRA": ["--quantize", "null"],
    "QLoRA int8": ["--quantize", "int8"],
    "QLoRA int4": ["--quantize", "int4"],
    "full float8": ["--method", "full", "--quantize", "float8"],
}
POLICIES = ("auto", "mixed_float16")


def run(made: pathlib.Path, out: pathlib.Path, args: argparse.Namespace, extra):
    command = [
        sys.executable, "-m", "kmp", "finetune",
        "--config", str(ROOT / "examples" / "finetune.yaml"),
        "--model", str(made / "preset"),
        "--data.train", str(made / "train.jsonl"),
        "--data.eval", str(made / "eval.jsonl"),
        "--output_dir", str(out),
        "--epochs", str(args.epochs),
        "--logging_steps", "5",
        "--save_steps", "null",
        *extra,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        return {"refused": done.stderr.strip().splitlines()[-1]}
    metrics = json.loads((out / "metrics.json").read_text())
    speeds = [r["tokens_per_second"] for r in metrics["records"][1:]]
    plan = [line for line in done.stdout.splitlines() if "parameters:" in line]
    return {
        "policy": metrics["policy"],
        "process_gib": metrics["peak_memory_gib"],
        "tensors_mib": metrics["peak_tensors_mib"],
        "estimate_mib": metrics["estimate_mib"],
        "tokens_per_second": statistics.median(speeds),
        "loss": metrics["records"][-1]["loss"],
        "accuracy": metrics["evaluations"][-1]["eval_accuracy"],
        "parameters": plan[0].split("parameters: ")[1].split(";")[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--archs", nargs="+", default=["llama", "gemma"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out", default="/tmp/finetune-table")
    args = parser.parse_args()
    maker = runpy.run_path(str(ROOT / "examples" / "finetune_data.py"))
    rows = []
    for arch in args.archs:
        made = pathlib.Path(args.out) / arch
        made.mkdir(parents=True, exist_ok=True)
        if not (made / "preset").exists():
            maker["write_data"](str(made))
            maker["make_preset"](
                str(made / "preset"), arch, args.hidden, args.layers, steps=300
            )
        for policy in POLICIES:
            for method in args.methods:
                extra = METHODS[method]
                out = made / f"{policy}-{method.replace(' ', '-')}"
                if out.exists():
                    subprocess.run(["rm", "-rf", str(out)], check=True)
                result = run(made, out, args, ["--policy", policy, *extra])
                rows.append({"arch": arch, "asked": policy, "method": method, **result})
                print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| model | policy | method | parameters (trainable of all) | process "
        "peak | tensors peak (estimate) | tokens/s | loss | held-out accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(
                f"| {r['arch']} | {r['asked']} | {r['method']} | refused: "
                f"{r['refused']} | | | | | |"
            )
            continue
        print(
            f"| {r['arch']} | {r['asked']} ({r['policy']}) | {r['method']} | "
            f"{r['parameters']} | {r['process_gib']:.2f} GiB | "
            f"{r['tensors_mib']:.1f} MiB ({r['estimate_mib']:.1f}) | "
            f"{r['tokens_per_second']:,.0f} | {r['loss']:.3f} | "
            f"{r['accuracy']:.3f} |"
        )


if __name__ == "__main__":
    main()
