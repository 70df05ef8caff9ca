"""Shared helpers of the benchmarks: interleaved timing with medians, saved-activation memory, conditions."""
import os
import platform
import statistics
import time
from typing import Callable, Dict, List

import torch


def conditions(threads: int) -> dict:
    """What the numbers were measured under (printed and written into the JSON)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(date_utc=time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime()), torch=torch.__version__,
                threads=threads, cpu_count=os.cpu_count(), machine=platform.machine(),
                processor=platform.processor() or platform.machine(), loadavg_1_5_15=load,
                note='shared CPU machine, other jobs running; interleaved timing, medians')


def interleaved_times(fns: Dict[str, Callable[[], None]], repeats: int, warmup: int = 2) -> Dict[str, List[float]]:
    """Time every fn ``repeats`` times, interleaved: each round calls every candidate once, the starting
    candidate rotating from round to round, so slow phases of the (shared) machine hit all alike."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
    return times


def median_iqr(xs: List[float]):
    """Median and interquartile range (statistics.quantiles' default 'exclusive' method; with 3 values
    the IQR is their range)."""
    xs = sorted(xs)
    if len(xs) < 2:
        return statistics.median(xs), 0.0
    q = statistics.quantiles(xs, n=4)
    return statistics.median(xs), q[2] - q[0]


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: List[torch.Tensor]) -> int:
    """Bytes of the distinct tensor storages autograd saves for backward during ``fn()`` (the memory a
    layer holds from its forward until its backward in training), parameters (``exclude``) not counted.

    CPU torch has no allocator peak counter; this counts what stays alive between forward and backward,
    which is what grows a training step's memory with the network's depth. Transient buffers freed inside
    the forward are not counted.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip:
            seen[ptr] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def device_times(fns: Dict[str, Callable[[], None]], repeats: int, warmup: int, device: str) -> Dict[str, List[float]]:
    """``interleaved_times`` for an accelerator: each call is timed with CUDA events on the current stream
    (the GPU time between them, not the host's launch time); one synchronization per round, none inside a
    timed call. On the CPU it is ``interleaved_times``. Seconds, like ``interleaved_times``."""
    if device == 'cpu':
        return interleaved_times(fns, repeats, warmup)
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    torch.cuda.synchronize()
    times = {n: [] for n in names}
    for r in range(repeats):
        k = r % len(names)
        events = []
        for n in names[k:] + names[:k]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[n]()
            end.record()
            events.append((n, start, end))
        torch.cuda.synchronize()
        for n, start, end in events:
            times[n].append(start.elapsed_time(end) / 1e3)
    return times
