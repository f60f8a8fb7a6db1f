"""The tools behind the command line: `kmp bench`, `kmp demo`, the commands
themselves, and measured runs in fresh processes."""
