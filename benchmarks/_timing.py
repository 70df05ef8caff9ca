"""Shared helpers of the benchmarks: interleaved timing with medians, saved-activation memory, conditions."""
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch


# glibc malloc that keeps freed memory: a fixed 32 MiB mmap threshold (the largest glibc accepts; blocks
# below it come from the heap) and no trimming of the heap's top. By default glibc returns large freed
# blocks to the OS, and the next allocation of that size page-faults on first touch, which on this CPU
# costs more than the pass that fills it: a layer's time then depends on the allocations of whatever ran
# before it (up to 3x here). A GPU's caching allocator has no such cost; 'retain' measures without it.
RETAIN_MALLOC_ENV = {'MALLOC_MMAP_THRESHOLD_': str(32 << 20), 'MALLOC_TRIM_THRESHOLD_': str(1 << 40)}


def malloc_mode() -> str:
    """'retain' when this process started with RETAIN_MALLOC_ENV, else 'default'."""
    return 'retain' if all(os.environ.get(k) == v for k, v in RETAIN_MALLOC_ENV.items()) else 'default'


def restart_with_retained_malloc(argv: List[str]) -> None:
    """Re-run this script (``argv``: its arguments) with RETAIN_MALLOC_ENV: glibc reads it only at start-up.
    No-op when already set; a one-line exit where glibc is not the C library."""
    if malloc_mode() == 'retain':
        return
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        raise SystemExit('--malloc retain sets glibc malloc tunables: it needs Linux with glibc')
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(sys.argv[0])] + list(argv),
              dict(os.environ, **RETAIN_MALLOC_ENV))


def minor_faults() -> int:
    """Minor page faults of this process so far (0 where the resource module is unavailable)."""
    try:
        import resource
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def count_ops(fn: Callable[[], None]) -> int:
    """ATen operators that ``fn()`` dispatches to kernels (forward and backward; views, detach and other
    metadata-only ops not counted). Device-independent: on a GPU each is at least one kernel launch (a few
    microseconds of host time), which bounds a small layer's speed from below."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (func.is_view or func.overloadpacket.__name__ in ('detach', 'alias', 'lift_fresh')):
                Counter.n += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn()
    return Counter.n


def conditions(threads: int) -> dict:
    """What the numbers were measured under (printed and written into the JSON)."""
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(date_utc=time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime()), torch=torch.__version__,
                threads=threads, cpu_count=os.cpu_count(), machine=platform.machine(),
                processor=platform.processor() or platform.machine(), loadavg_1_5_15=load, malloc=malloc_mode(),
                note='shared CPU machine, other jobs running; interleaved timing, medians')


def interleaved_times(fns: Dict[str, Callable[[], None]], repeats: int, warmup: int = 2,
                      faults: Optional[Dict[str, List[int]]] = None) -> Dict[str, List[float]]:
    """Time every fn ``repeats`` times, interleaved: each round calls every candidate once, the starting
    candidate rotating from round to round, so slow phases of the (shared) machine hit all alike.
    ``faults``: a dict filled with the minor page faults of each timed call (see RETAIN_MALLOC_ENV)."""
    names = list(fns)
    for _ in range(warmup):
        for n in names:
            fns[n]()
    times = {n: [] for n in names}
    if faults is not None:
        faults.update({n: [] for n in names})
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            f0 = minor_faults()
            t0 = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t0)
            if faults is not None:
                faults[n].append(minor_faults() - f0)
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
    """``interleaved_times`` for an accelerator, synchronized per call: the device is idle when a call starts
    and the call's time runs until its last kernel has finished (host clock around ``fn(); synchronize()``).
    So the host's launch overhead is counted: a layer of 100 small kernels costs what it costs in a training
    step, not the GPU time of its kernels alone (timing a queue of back-to-back calls with CUDA events hides
    the launches behind the previous call's work). On the CPU it is ``interleaved_times``. Seconds."""
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
        for n in names[k:] + names[:k]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fns[n]()
            torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    return times
