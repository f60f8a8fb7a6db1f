"""The `kmp` command line's parser and entry point.

Parsing needs no TensorFlow: `kmp --help`, `kmp bench --help` and
`kmp --version` answer without importing it. A command imports it (quietly,
`kmp_cli.quiet`) and then runs from `kmp.tools.cli`.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import pathlib
import sys
from collections.abc import Sequence

from kmp_cli import finetune_config
from kmp_cli import quiet


def kmp_version() -> str:
    """kmp's version, read from `kmp/version.py` without importing kmp (whose
    import imports TensorFlow)."""
    spec = importlib.util.find_spec("kmp")
    if spec is None or not spec.submodule_search_locations:
        return "unknown"
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "version.py"
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "__version__" for t in node.targets)
            and isinstance(node.value, ast.Constant)
        ):
            return str(node.value.value)
    return "unknown"


class _Help(argparse.HelpFormatter):
    """Shows each option's default after its help, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or (
            "%(default)" in text
        ):
            return text
        return f"{text} (default: %(default)s)"


def _add_import(parser: argparse.ArgumentParser, when: str) -> None:
    """The `--import MODULE` option of the commands that load a .keras file."""
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=f"import MODULE {when}: the module that registers a .keras file's "
        "own layer classes (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `kmp` command line."""
    parser = argparse.ArgumentParser(
        prog="kmp",
        description="Mixed-precision training for Keras 3 on TensorFlow.",
    )
    parser.add_argument("--version", action="version", version=f"kmp {kmp_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "policies",
        help="list the precision policies and what 'auto' picks",
        description="The precision policies, and what 'auto' picks on this "
        "machine and why.",
    )
    p = sub.add_parser(
        "doctor",
        help="what this machine supports and which policy to use",
        description="This machine's CPU and accelerators, their 16-bit math, "
        "the policy 'auto' picks and why, the fused-update rule, versions and "
        "warnings; with --model, an estimate of the memory training the model "
        "will hold, per policy, and the layers whose activations reach "
        "float16's range.",
        formatter_class=_Help,
    )
    p.add_argument(
        "--model",
        metavar="FILE.keras",
        help="estimate the memory training this saved model holds: weights, "
        "optimizer state (its own optimizer, else Adam), and the step's tensors "
        "(measured by two small forward and backward passes)",
    )
    p.add_argument(
        "--policies",
        help="comma-separated policies to estimate under (default: float32 and "
        "the one 'auto' picks)",
    )
    p.add_argument(
        "--batch-size", type=int, default=32, help="the batch size to estimate at"
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="also print the largest batch whose estimate fits SIZE of tensors "
        "(e.g. 4G)",
    )
    p.add_argument(
        "--sample",
        metavar="FILE.npy",
        help="with --model: a batch of real inputs (.npy, or .npz with one "
        "array per input name) for the activation range check (default: "
        "random inputs at --batch-size)",
    )
    _add_import(p, "first")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser(
        "bench",
        help="the same model under several policies, side by side",
        description="Trains the same model under each policy, each run in a "
        "fresh process, and prints step time, speed-up over float32, memory, "
        "loss and skipped steps.",
        formatter_class=_Help,
    )
    p.add_argument(
        "--model", default="mlp", help="mlp, cnn, transformer, or a .keras file"
    )
    p.add_argument(
        "--policies",
        default="float32,mixed_bfloat16,mixed_float16",
        help="comma-separated policy names (see `kmp policies`; 'auto' too)",
    )
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="fresh-process runs per policy, order alternating",
    )
    p.add_argument(
        "--keras",
        action="store_true",
        help="also run each policy with plain Keras, for comparison",
    )
    _add_import(p, "in each run first")
    p.add_argument(
        "--keras-budget",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="stop a plain-Keras run after this long (0: no limit): its float16 "
        "takes minutes per step on some CPUs",
    )
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="instead of timing one batch size: find, per policy, the largest "
        "batch that trains within SIZE of peak memory (e.g. 4G, 512M; the "
        "process's resident memory, TensorFlow's runtime included, or the "
        "GPU's where there is one), by training each size tried for 2 steps "
        "in a fresh process, from --batch-size",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=1 << 16,
        help="the largest batch size --memory-budget tries",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write a PNG")
    p = sub.add_parser(
        "demo",
        help="train on a real dataset under float32 and kmp's policy",
        description="Trains a model on scikit-learn's bundled handwritten "
        "digits under float32, the policy 'auto' picks and mixed_float16, "
        "each in a fresh process, and compares speed, memory and accuracy.",
        formatter_class=_Help,
    )
    p.add_argument(
        "--model",
        choices=("mlp", "cnn", "transformer"),
        default="mlp",
        help="mlp (its step is mostly matmuls, so a 16-bit speed-up shows), or "
        "the small cnn or transformer",
    )
    p.add_argument("--epochs", type=int, default=12, help="epochs per policy")
    p.add_argument(
        "--plot", default="kmp-demo.png", metavar="PATH.png", help="write a PNG"
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser(
        "finetune",
        help="fine-tune a KerasHub causal LM from a local preset by a config",
        description="Fine-tunes a KerasHub causal LM from a local preset "
        "directory on a JSONL file, with LoRA or QLoRA under mixed precision, "
        "as a YAML config says. Every key is also a flag that overrides the "
        "file (its value read as YAML). The config is checked whole before "
        "any model is loaded.",
    )
    finetune_config.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `kmp` command line; returns the exit status."""
    import subprocess

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "finetune":
            # Read before TensorFlow starts; its problems are listed with
            # the command's own checks.
            args.finetune = finetune_config.read(args)
        quiet.start_tensorflow()
        from kmp.tools import cli

        return cli.run(args)
    except (ValueError, ImportError, RuntimeError) as e:
        print(f"kmp {args.command}: {e}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as e:
        print(
            f"kmp {args.command}: a run took longer than {e.timeout:g}s and was "
            "stopped; use fewer --steps or a smaller --batch-size.",
            file=sys.stderr,
        )
        return 2
