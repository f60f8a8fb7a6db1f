"""The `kmp` command line. The only module that prints."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kmp._table import format_table
from kmp.version import __version__


def _cmd_policies(args: argparse.Namespace) -> int:
    from kmp import hardware
    from kmp import policy as policy_lib

    rows = []
    for name in policy_lib.list_policies():
        if name == policy_lib.AUTO:
            continue
        p = policy_lib.get(name)
        scaling = "yes" if p.needs_loss_scaling else "no"
        rows.append((p.name, p.compute_dtype, p.variable_dtype, scaling))
    print(format_table(("name", "compute", "variables", "loss scaling"), rows))
    choice = hardware.resolve_auto()
    print(f"\n'auto' on this machine: {choice.policy} ({choice.reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kmp",
        description="Mixed-precision training for Keras 3 on TensorFlow.",
    )
    parser.add_argument("--version", action="version", version=f"kmp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "policies", help="list the precision policies and what 'auto' picks"
    )
    p.set_defaults(func=_cmd_policies)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the `kmp` command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)
