"""Launch counts of one call (benchmarks/gpu.py): ATen operators, Triton kernel launches and, on CUDA, the
kernels the GPU ran (torch.profiler). Each launch costs ~4-6 us of host time, so at small FPN levels the
count, not the bytes, sets a layer's time."""
import contextlib
from typing import Callable, Optional

import torch

from benchmarks._timing import count_ops


@contextlib.contextmanager
def _counting_triton_runs(counter: list):
    """Count ``kernel[grid](...)`` launches: every Triton kernel, compiled (``JITFunction``) or interpreted
    (``InterpretedFunction`` under ``TRITON_INTERPRET=1``), launches through its class's ``run`` (autotuned
    ones too, after their first call's benchmarking). Without triton it counts nothing."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction
        classes.append(JITFunction)
        from triton.runtime.interpreter import InterpretedFunction
        classes.append(InterpretedFunction)
    except ImportError:
        pass
    originals = [(cls, cls.__dict__['run']) for cls in classes if 'run' in cls.__dict__]

    def wrap(run):
        def counted(self, *args, grid, warmup, **kwargs):
            if not warmup:
                counter[0] += 1
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        return counted

    for cls, run in originals:
        cls.run = wrap(run)
    try:
        yield
    finally:
        for cls, run in originals:
            cls.run = run


def count_triton_launches(fn: Callable[[], None]) -> int:
    """Triton launches of ``fn()``: normdense's through its launchers (those kept in the launch cache call the
    compiled kernel directly, not ``kernel[grid]``), any other through ``kernel[grid]``."""
    counter = [0]
    try:
        from normdense.kernels import launch
    except ImportError:  # no triton
        return 0
    with launch.counting() as ours, _counting_triton_runs(counter):
        fn()
    # ours through Launcher.launch went through kernel[grid] too (unless stubbed): counted once, as ours
    return ours[0] + max(0, counter[0] - ours[1])


def count_cuda_kernels(fn: Callable[[], None]) -> Optional[int]:
    """Work items the GPU ran during ``fn()`` (kernels, memsets and memcpys: each a launch), from
    torch.profiler; None where it cannot tell (no CUDA, or the profiler saw no GPU activity)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    n = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return n or None


def cuda_kernel_ms(fn: Callable[[], None], repeats: int = 5) -> Optional[float]:
    """The GPU's own time for ``fn()``: the durations of the kernels, memsets and memcpys it ran (torch.profiler,
    CUPTI), summed, median of ``repeats`` calls, in ms; None off CUDA. The host's time is not in it: at sizes
    where the host is the bottleneck this is what the kernels would take if it were not."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile
    totals = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        us = 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                us += getattr(e, 'device_time', None) or getattr(e, 'cuda_time', 0.0)
        totals.append(us / 1e3)
    totals.sort()
    return totals[len(totals) // 2] or None


def launch_counts(fn: Callable[[], None]) -> dict:
    """``aten_ops`` (non-view operators, benchmarks/_timing.count_ops), ``triton_launches`` and ``gpu_kernels``
    (None off CUDA) of one call each; ``launches``: the GPU's count where known, else ATen ops + Triton
    launches (an upper bound: some ATen ops launch nothing)."""
    aten = count_ops(fn)
    triton_n = count_triton_launches(fn)
    gpu = count_cuda_kernels(fn)
    return dict(aten_ops=aten, triton_launches=triton_n, gpu_kernels=gpu,
                launches=gpu if gpu is not None else aten + triton_n)
