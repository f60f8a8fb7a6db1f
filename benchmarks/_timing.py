"""Interleaved timing, and the machine readings, shared by the benchmarks.

These machines are shared: an epoch's time jumps between two modes (seen
here: 13 ms and 22 ms per step for the same model) with no change in the
work. Every variant is therefore run in turn, in alternating order, many
times; the ratio of the *fastest* runs (the least disturbed ones, as
`timeit` does) is the headline, and medians are reported beside it.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

# What `--clock` names: wall time, or this process's CPU time.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def add_clock_argument(parser, default: str = "wall", help: str | None = None):
    """Adds `--clock wall|cpu` to `parser`; `CLOCKS[args.clock]` reads it."""
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default=default,
        help=help or "wall time, or this process's CPU time (steadier on shared cores)",
    )


def interleaved(
    runs: dict[str, Callable[[], None]], repeats: int, clock=time.perf_counter
) -> dict:
    """Times each callable `repeats` times, ABC then CBA; one warm-up each.

    `clock` is wall time by default; `time.process_time` (CPU time of this
    process, all threads) is steadier when other tenants take the cores.
    """
    for run in runs.values():
        run()
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            start = clock()
            runs[name]()
            times[name].append(clock() - start)
    return times


def status_mib(field: str) -> float:
    """A `VmRSS`/`VmHWM`-style field of /proc/self/status, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only).")


def cpu_model() -> str:
    """The CPU's model name (as `lscpu` prints it), else the architecture."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(times: dict[str, list[float]], steps: int, baseline: str) -> dict:
    """ms/step (best and median) per variant, and ratios against `baseline`:
    of the best runs, of the medians, and the median of the paired ratios
    (each run against the baseline's run beside it, which shared the
    machine's state), with their quartiles."""
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    paired = {}
    for k, v in times.items():
        ratios = [a / b for a, b in zip(v, times[baseline], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        paired[k] = {
            "median": round(statistics.median(ratios), 4),
            "q1": round(quartiles[0], 4),
            "q3": round(quartiles[-1], 4),
        }
    return {
        "machine": cpu_model(),
        "cpus": os.cpu_count(),
        "repeats": len(next(iter(times.values()))),
        "best_ms_per_step": {k: round(1000 * v / steps, 2) for k, v in best.items()},
        "median_ms_per_step": {
            k: round(1000 * v / steps, 2) for k, v in median.items()
        },
        f"best_ratio_vs_{baseline}": {
            k: round(v / best[baseline], 4) for k, v in best.items()
        },
        f"median_ratio_vs_{baseline}": {
            k: round(v / median[baseline], 4) for k, v in median.items()
        },
        f"paired_ratio_vs_{baseline}": paired,
    }
