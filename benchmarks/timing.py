"""Timing shared by the kernel benchmarks: wall-clock medians, and GPU kernel durations from a profiler trace."""
from __future__ import annotations

import collections
import gzip
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def median_ms(fn, *args, repeats: int = 15, warmups: int = 1) -> float:
    """Median wall milliseconds of fn(*args), waiting for the device, after `warmups` calls (the first compiles)."""
    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def gpu_kernel_spans(trace_dir: str) -> list[tuple[str, float, float]]:
    """(kernel name, start µs, duration µs) of each kernel on the GPU streams of the perfetto trace jax.profiler
    wrote; [] when the trace has no GPU (a CPU run)."""
    path = next(Path(trace_dir).rglob("perfetto_trace.json.gz"))
    events = json.loads(gzip.decompress(path.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    gpu_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                and "GPU" in str(e.get("args", {}).get("name", "")).upper()}
    threads = {(e["pid"], e["tid"]): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in gpu_pids}
    # A GPU's trace has a line per stream (the kernels) beside lines of XLA ops and modules spanning them.
    streams = {key for key, name in threads.items() if name.lower().startswith("stream")}
    return [(e["name"], float(e.get("ts", 0.0)), float(e.get("dur", 0.0))) for e in events
            if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams]


def gpu_kernel_events(trace_dir: str) -> list[tuple[str, float]]:
    """(kernel name, µs) of each kernel on the GPU streams of the trace (see gpu_kernel_spans)."""
    return [(name, dur) for name, _, dur in gpu_kernel_spans(trace_dir)]


def gpu_idle_us(spans, calls: int, gap_us: float = 20.0) -> tuple[float, int]:
    """(µs, count) of the gaps longer than gap_us between consecutive GPU kernels (gpu_kernel_spans of a trace of
    `calls` calls), leaving out the calls - 1 longest (the host between calls): the time a call's GPU waited on its
    host (launches, a loop's per-iteration synchronisation) rather than on its kernels."""
    gaps, end = [], None
    for start, stop in sorted((start, start + dur) for _, start, dur in spans):
        if end is not None and start - end > gap_us:
            gaps.append(start - end)
        end = stop if end is None else max(end, stop)
    gaps = sorted(gaps)[: max(len(gaps) - (calls - 1), 0)]
    return float(sum(gaps)), len(gaps)


def gpu_kernel_times(spans) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, total µs)} over gpu_kernel_spans of a trace."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, _, us in spans:
        totals[name][0] += 1
        totals[name][1] += us
    return {name: (n, us) for name, (n, us) in totals.items()}


def _traced_kernels(fn, *args, calls: int, warmups: int) -> list[tuple[str, float]]:
    """(kernel name, µs) of every GPU kernel in a profiler trace of `calls` calls of fn(*args) after `warmups`."""
    for _ in range(warmups):
        jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        return gpu_kernel_events(d)


def kernel_ms(fn, *args, prefix: str, calls: int = 3, warmups: int = 1) -> float | None:
    """Median GPU milliseconds of one launch of the kernels whose names start with `prefix`, over a profiler trace of
    `calls` calls of fn(*args) after `warmups`; None where the trace holds no such kernel (on a CPU, say). Unlike a
    wall-clock median this leaves out dispatch, the small ops around the kernel and a loop's per-iteration cost."""
    durations = [us for name, us in _traced_kernels(fn, *args, calls=calls, warmups=warmups) if name.startswith(prefix)]
    return float(np.median(durations)) / 1e3 if durations else None


def call_kernels_ms(fn, *args, calls: int = 5, warmups: int = 2) -> float | None:
    """GPU milliseconds of all kernels of one call of fn(*args) (whatever XLA named its fusions), averaged over a
    profiler trace of `calls` calls; None where the trace holds no GPU kernel (on a CPU)."""
    events = _traced_kernels(fn, *args, calls=calls, warmups=warmups)
    return sum(us for _, us in events) / calls / 1e3 if events else None


def write_rows(path: str | None, rows: list[dict]) -> None:
    """A benchmark's result rows as JSON at `path` (nothing for None), with the device and JAX version."""
    if path:
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
