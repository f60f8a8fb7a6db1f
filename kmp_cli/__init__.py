"""The part of the `kmp` command line that needs no TensorFlow: its parser
(so that `kmp --help` answers at once) and a quiet start for TensorFlow
(so that its C++ start-up notices do not read like failures).

The commands themselves are in `kmp.tools.cli`.
"""

from kmp_cli.command_line import build_parser
from kmp_cli.command_line import main
from kmp_cli.quiet import start_tensorflow

__all__ = ["build_parser", "main", "start_tensorflow"]
