"""The tensors a stretch of training holds at once, read from TensorFlow's
profiler: its allocators' `MemoryAllocation` events (with oneDNN, requests
under 256 KiB go to a pool that records none; every tensor that matters for
a step's memory is larger).

The bytes the tensors requested, not the allocator's own count
(`tf.config.experimental.get_memory_info`): that count is of the blocks that
served the requests, and its blocks follow the history of frees (a 16 MiB
gradient once served from a 24 MiB block reads as 24).
"""

from __future__ import annotations

import glob
from typing import NamedTuple


class Tensor(NamedTuple):
    bytes: int
    op: str
    shape: str
    dtype: str


def _dtype(code) -> str:
    import tensorflow as tf

    try:
        return tf.dtypes.as_dtype(int(code)).name
    except (TypeError, ValueError):
        return str(code or "?")


def live_at_peak(trace_dir: str) -> tuple[int, list[Tensor]]:
    """The peak, over the profiled window, of the bytes requested by the
    tensors allocated in it and still live, and those tensors (the op that
    made each, its shape and dtype). A block allocated before the window
    (a weight, an optimizer slot) is not counted."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    (path,) = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                kind = names.get(event.metadata_id)
                if kind not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                stats = {
                    stat_names.get(s.metadata_id): (
                        # Strings repeated across events (op, shape) are
                        # stored once, as a reference.
                        stat_names.get(s.ref_value)
                        if s.ref_value
                        else s.str_value or s.uint64_value or s.int64_value
                    )
                    for s in event.stats
                }
                time = line.timestamp_ns * 1000 + event.offset_ps
                # At one time, a block is freed before its address is reused.
                order = 0 if kind == "MemoryDeallocation" else 1
                tensor = Tensor(
                    stats["requested_bytes"],
                    str(stats.get("tf_op") or "?"),
                    str(stats.get("shape") or ""),
                    _dtype(stats.get("data_type")),
                )
                events.append((time, order, stats["addr"], tensor))
    if not events:
        raise RuntimeError("the profiler recorded no allocation")
    live: dict[int, Tensor] = {}
    now = peak = 0
    at_peak: list[Tensor] = []
    for _, order, address, tensor in sorted(events, key=lambda e: e[:3]):
        freed = live.pop(address, None)
        now -= freed.bytes if freed else 0
        if order == 1:
            live[address] = tensor
            now += tensor.bytes
            if now > peak:
                peak, at_peak = now, list(live.values())
    return peak, at_peak
