"""Shared helpers for the benchmarks: timing against a baseline, peak memory, reports.

How we measure on this (small, noisy, CPU-only) machine, see shared/PERFORMANCE.md beside
the repository:

* Speed is reported as a **ratio to a baseline** (a plain forward+backward of the same
  model on the same batch, in the same process). Baseline and method alternate in one
  loop ``B M B M ... B``; each method measurement is divided by the mean of the two
  baseline measurements around it, and we report the median of these per-repeat ratios.
  Other jobs on the 2 cores distort ratios badly (a small model's many short parallel
  regions slow down far more than a large GEMM), so :class:`QuietGate` waits (bounded)
  for the CPUs to be free before each baseline, and repeats whose baselines ran more
  than 1.5x slower than the fastest one are left out of the median.
  Every measurement times ``inner`` back-to-back calls, with ``inner`` calibrated so that
  one measurement lasts at least ``min_time`` seconds (short calls are too noisy alone).
* **Peak memory** on CPU is the increase of the process's resident set: release free heap
  memory to the OS (``malloc_trim``), read ``VmRSS``, reset the high-water mark by writing
  ``5`` to ``/proc/self/clear_refs``, run the call once, read ``VmHWM``; the peak is
  ``VmHWM - VmRSS(before)``, i.e. every page the call touched beyond what was resident
  (tensors, allocator slack, autograd buffers, the returned result). Where that interface
  is unavailable we fall back to the sum of the tensor allocation events of
  ``torch.profiler`` (``profile_memory=True``), which sees tensors only.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import platform
import re
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

MB = 2**20
#: The repository root (the parent of ``benchmarks/``).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- recorded commands ---------------------------------------------------------------------
def portable_path(path: str) -> str:
    """A path as it is recorded in the docs and the JSON results: machine-independent.

    An absolute path inside the repository becomes relative to the repository root (as a
    reader types it there); an absolute path outside it is recorded by its file name only
    (where it lay on this machine means nothing elsewhere); a relative path is kept.
    """
    if not os.path.isabs(path):
        return path
    path = os.path.normpath(path)
    for root in {ROOT, os.path.realpath(ROOT)}:
        if path == root:
            return "."
        if path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return os.path.basename(path)


def portable_command(script: str, argv: Sequence[str]) -> str:
    """``python SCRIPT ARGS`` with every absolute path argument made :func:`portable_path`.

    Paths are recognized as whole arguments and after the first ``=`` of one
    (``--json=PATH``, ``NAME=PATH``).
    """

    def show(arg: str) -> str:
        name, eq, value = arg.partition("=")
        if eq and os.path.isabs(value):
            return f"{name}={portable_path(value)}"
        return portable_path(arg)

    return " ".join(["python", script, *(show(a) for a in argv)]).strip()


# -- machine -----------------------------------------------------------------------------
def machine_info() -> Dict[str, Any]:
    """torch version, thread count, CPU model and core count, Python version."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def machine_line(info: Optional[Dict[str, Any]] = None) -> str:
    """One-line description of :func:`machine_info`."""
    i = info or machine_info()
    return (
        f"torch {i['torch']}, {i['threads']} threads, {i['cpu']} ({i['cores']} cores), "
        f"Python {i['python']}"
    )


def package_version(dist: str) -> Optional[str]:
    """Installed version of a distribution, or ``None``."""
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return None


# -- other load on the machine ------------------------------------------------------------------
def _cpu_times() -> Optional[Tuple[int, int]]:
    """``(busy, total)`` jiffies of all CPUs from /proc/stat, or ``None``."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def foreign_load(window: float = 0.05) -> float:
    """Fraction of all CPUs busy during ``window`` seconds while this process sleeps."""
    a = _cpu_times()
    time.sleep(window)
    b = _cpu_times()
    if a is None or b is None or b[1] == a[1]:
        return 0.0
    return (b[0] - a[0]) / (b[1] - a[1])


class QuietGate:
    """Waits, before a measurement, until other processes leave the CPUs (bounded).

    Other jobs on a 2-core machine distort ratios in a way no statistic repairs (thread
    barriers of short parallel regions suffer far more than long GEMMs). Before each
    measurement the gate samples the CPU load while we sleep and waits while it exceeds
    ``threshold``, at most ``max_wait`` seconds per measurement and ``budget`` seconds in
    all. ``waited`` / ``loaded`` count the seconds spent waiting and the measurements
    that started under load anyway.
    """

    def __init__(self, threshold: float = 0.25, max_wait: float = 3.0, budget: float = 60.0):
        self.threshold, self.max_wait, self.budget = threshold, max_wait, budget
        self.waited = 0.0
        self.measurements = 0
        self.loaded = 0

    def __call__(self) -> None:
        self.measurements += 1
        if self.max_wait <= 0 or self.waited >= self.budget:
            return
        start = time.perf_counter()
        while foreign_load() > self.threshold:
            spent = time.perf_counter() - start
            if spent > self.max_wait or self.waited + spent > self.budget:
                self.loaded += 1
                break
            time.sleep(0.2)
        self.waited += time.perf_counter() - start

    def summary(self) -> Dict[str, Any]:
        return {
            "threshold": self.threshold,
            "waited_s": round(self.waited, 1),
            "measurements": self.measurements,
            "started_under_load": self.loaded,
        }


_NO_GATE: Callable[[], None] = lambda: None  # noqa: E731


# -- timing --------------------------------------------------------------------------------
def quantile_ms(fn: Callable[[], Any], repeats: int = 5, q: float = 0.5, warmup: int = 1) -> float:
    """The ``q``-quantile (lower) of ``repeats`` timed calls of ``fn``, in ms, after
    ``warmup`` untimed calls (a quick figure for one operation; :func:`compare` for ratios).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[int(q * (repeats - 1))] * 1e3


def _time(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call of ``inner`` back-to-back calls (results dropped at once).

    Python's cyclic garbage collector is paused meanwhile, as in :mod:`timeit`.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - start) / inner
    finally:
        if enabled:
            gc.enable()


def calibrate(fn: Callable[[], Any], min_time: float, warmup: int = 1) -> int:
    """Run ``fn`` ``warmup`` times, then return the call count lasting ``min_time``."""
    for _ in range(max(0, warmup - 1)):
        fn()
    t = _time(fn, 1)
    return max(1, int(min_time / max(t, 1e-9)) + (t < min_time))


def compare(
    baseline: Callable[[], Any],
    method: Callable[[], Any],
    *,
    repeats: int,
    min_time: float = 0.02,
    warmup: int = 2,
    inner_baseline: Optional[int] = None,
    estimate: Optional[float] = None,
    gate: Callable[[], None] = _NO_GATE,
    tolerance: float = 1.5,
    baseline_floor: Optional[float] = None,
) -> Dict[str, Any]:
    """Time ``method`` against ``baseline``, alternating ``B M B M ... B``.

    Args:
        baseline: The reference call (e.g. a plain forward+backward).
        method: The call to measure.
        repeats: Number of method measurements.
        min_time: Minimal duration of one measurement (sets the inner call count).
        warmup: Untimed calls of ``method`` before timing.
        inner_baseline: Inner call count of the baseline (calibrated if ``None``).
        estimate: Seconds per call of ``method`` measured by the caller on a warm call;
            with ``warmup=0`` it replaces the calibration call.
        gate: Called before every baseline measurement (e.g. a :class:`QuietGate`); the
            method measurement follows its baseline at once.
        tolerance: Repeats whose two baselines are not both within ``tolerance`` times
            the fastest baseline of this comparison (and within ``2 * tolerance`` times
            ``baseline_floor``) count as disturbed by other jobs and are left out of the
            ratio, unless that leaves fewer than half of them: then all count and
            ``disturbed`` is set. ``disturbed`` is also set when the interquartile range
            of the kept ratios exceeds 30% of their median (``spread``).
        baseline_floor: The fastest baseline time seen so far (e.g. in earlier
            comparisons of the same baseline).

    Returns:
        ``time`` (median seconds per call of ``method``), ``baseline_time`` (median of the
        baseline), ``ratio`` (median of the per-repeat ratios of the undisturbed
        repeats), ``ratios`` (all of them), ``clean_repeats``, ``spread``,
        ``disturbed``, the ``baseline_times`` and the inner call counts.

    """
    if estimate is not None and warmup == 0:
        inner_m = max(1, int(min_time / max(estimate, 1e-9)) + (estimate < min_time))
    else:
        inner_m = calibrate(method, min_time, warmup)
    inner_b = inner_baseline or calibrate(baseline, min_time, 1)
    gate()
    tb = [_time(baseline, inner_b)]
    tm: List[float] = []
    for _ in range(repeats):
        tm.append(_time(method, inner_m))
        gate()
        tb.append(_time(baseline, inner_b))
    ratios = [m / (0.5 * (b0 + b1)) for m, b0, b1 in zip(tm, tb[:-1], tb[1:])]
    limit = tolerance * min(tb)
    if baseline_floor is not None:  # slow drift is fine, a whole comparison under load not
        limit = min(limit, 2 * tolerance * baseline_floor)
    clean = [i for i in range(repeats) if max(tb[i], tb[i + 1]) <= limit]
    fell_back = 2 * len(clean) < repeats
    if fell_back:
        clean = list(range(repeats))
    kept = sorted(ratios[i] for i in clean)
    spread = 0.0
    if len(kept) >= 2:
        q1, _, q3 = statistics.quantiles(kept, n=4)
        spread = (q3 - q1) / statistics.median(kept)
    return {
        "baseline_times": tb,
        "spread": spread,
        "disturbed": fell_back or spread > 0.3,
        "time": statistics.median(tm[i] for i in clean),
        "baseline_time": statistics.median(tb),
        "ratio": statistics.median(ratios[i] for i in clean),
        "ratios": ratios,
        "clean_repeats": len(clean),
        "inner": inner_m,
        "inner_baseline": inner_b,
    }


# -- peak memory -----------------------------------------------------------------------------
def _proc_status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_supported() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_kb("VmHWM")
        _proc_status_kb("VmRSS")
        return True
    except (OSError, KeyError):
        return False


_RSS_OK: Optional[bool] = None


def memory_method() -> str:
    """``"rss"`` (VmHWM reset via /proc/self/clear_refs) or ``"profiler"``."""
    global _RSS_OK
    if _RSS_OK is None:
        _RSS_OK = _rss_supported()
    return "rss" if _RSS_OK else "profiler"


def _peak_rss(fn: Callable[[], Any]) -> Tuple[int, Any, float]:
    _malloc_trim()
    before = _proc_status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = time.perf_counter()
    result = fn()  # the result is part of the peak: alive until VmHWM is read
    seconds = time.perf_counter() - start
    peak = _proc_status_kb("VmHWM")
    return max(0, peak - before) * 1024, result, seconds


def _peak_profiler(fn: Callable[[], Any]) -> Tuple[int, Any, float]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    events = [
        (e.time_range.start, e.self_cpu_memory_usage)
        for e in prof.events()
        if e.self_cpu_memory_usage
    ]
    live = peak = 0
    for _, delta in sorted(events, key=lambda x: x[0]):
        live += delta
        peak = max(peak, live)
    return peak, result, seconds


def peak_memory_of(fn: Callable[[], Any]) -> Tuple[int, Any, float]:
    """``(peak bytes, result, seconds)`` of one call of ``fn`` (see the module doc).

    The seconds include the memory bookkeeping; use them as an estimate only.
    """
    if memory_method() == "rss":
        return _peak_rss(fn)
    return _peak_profiler(fn)


def peak_memory(fn: Callable[[], Any], repeats: int = 1) -> int:
    """Peak memory of one call of ``fn`` in bytes, the minimum over ``repeats`` calls."""
    return min(peak_memory_of(fn)[0] for _ in range(max(1, repeats)))


# -- comparisons -------------------------------------------------------------------------------
def max_abs_diff(a: Any, b: Any) -> float:
    """Largest absolute difference between tensors or dicts of tensors (same keys)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            missing = sorted(set(a) ^ set(b))
            raise KeyError(f"different parameters: {missing[:5]}")
        return max(max_abs_diff(a[k], b[k]) for k in a)
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    if a.shape != b.shape:
        raise ValueError(f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    if a.numel() == 0:
        return 0.0
    a, b = a.reshape(a.shape[0] if a.dim() else 1, -1), b.reshape(b.shape[0] if b.dim() else 1, -1)
    rows = max(1, 2**22 // max(1, a.shape[1]))  # bounded temporaries (16 MB in fp32)
    dtype = torch.promote_types(a.dtype, b.dtype)
    return max(
        (a[i : i + rows].to(dtype) - b[i : i + rows].to(dtype)).abs().max().item()
        for i in range(0, a.shape[0], rows)
    )


def max_abs(a: Any) -> float:
    """Largest absolute entry of a tensor or dict of tensors."""
    if isinstance(a, dict):
        return max(max_abs(v) for v in a.values())
    return torch.as_tensor(a).detach().abs().max().item()


# -- reports ------------------------------------------------------------------------------------
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (cells converted with ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def update_doc_section(path: str, title: str, body: str, intro: str = "# Benchmarks\n") -> None:
    """Write or replace the ``## {title}`` section of a Markdown file.

    The section runs from its heading to the next ``## `` heading (or the end of the file);
    other sections are left untouched. A missing file is created with ``intro``.
    """
    text = intro
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    section = f"## {title}\n\n{body.strip()}\n"
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as indented JSON."""
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
