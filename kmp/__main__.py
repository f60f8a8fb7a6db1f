"""`python -m kmp` runs the `kmp` command line."""

import sys

from kmp_cli import main

sys.exit(main())
