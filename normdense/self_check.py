"""Import the whole stack normdense runs on, print its versions, and run one of mmcv's ops (the last step
of `make install`; also `python -m normdense.self_check` in any environment). Where torch sees a GPU and
triton is installed, each engine layer (BCN estimate and batch, GN+PN, Unitization) runs two training calls
(forward + backward; the second through the launches the first kept) on the Triton and on the ATen backend at a
detector's map size, in float32 and under bf16 autocast: per layer the largest differences (output, input
gradient, parameter gradients, buffers) and the ms per forward + backward against nn.GroupNorm's; exit status
1, one line naming the layer and ``NORMDENSE_BACKEND=aten``, where they differ beyond a tolerance (TOLERANCE).
Without a GPU that part says it is skipped.

Exit status 1, with one line naming the fix, when mmcv's ops do not import or run under the installed torch
(a wheel built for another torch, e.g. from pip's cache: ``nms`` is run on a tiny CPU tensor, and on CUDA
where torch sees a GPU), when torch sees a CUDA GPU but mmcv's ops were compiled without CUDA (RoIAlign,
NMS, ... would fail on the GPU) or for another CUDA major version, and when mmdet or mmseg (which need the
ops) meet mmcv-lite. mmcv-lite alone passes: normdense's layers need no op.
"""
import functools
import importlib
import math
import sys
from typing import NamedTuple, Optional

from normdense.errors import MMCV_NO_OPS, MMCV_REBUILD, mmcv_ops_problem

NO_CUDA = 'not available'  # what mmcv.ops.get_compiling_cuda_version() returns for a CPU-only build

FIX = ("rebuild mmcv with its CUDA ops (FORCE=1 make install, with the nvcc of torch's CUDA on PATH) or "
       "use OpenMMLab's prebuilt mmcv: pip install -U openmim && mim install mmcv==2.1.0")


def cuda_ops_problem(gpu_available: bool, torch_cuda: Optional[str], mmcv_cuda: str) -> Optional[str]:
    """One line on why mmcv's ops cannot run on this machine's GPU, or None when they can (or no GPU).

    Args:
        gpu_available: ``torch.cuda.is_available()``.
        torch_cuda: ``torch.version.cuda`` (None for a CPU build of torch).
        mmcv_cuda: ``mmcv.ops.get_compiling_cuda_version()``.
    """
    if not gpu_available:
        return None
    if mmcv_cuda == NO_CUDA:
        return f"torch sees a CUDA {torch_cuda} GPU but mmcv's ops were compiled without CUDA: {FIX}"
    if torch_cuda and mmcv_cuda.split('.')[0] != torch_cuda.split('.')[0]:
        return f"mmcv's ops were compiled for CUDA {mmcv_cuda} but torch uses CUDA {torch_cuda}: {FIX}"
    return None


def run_nms(device: str) -> None:
    """mmcv's ``nms`` on three boxes on ``device``; raises when the compiled op does not run (or is wrong)."""
    import torch
    from mmcv.ops import nms
    boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [20., 20., 30., 30.]], device=device)
    _, keep = nms(boxes, torch.tensor([0.9, 0.8, 0.7], device=device), iou_threshold=0.5)
    if keep.cpu().tolist() != [0, 2]:
        raise RuntimeError(f'nms kept boxes {keep.cpu().tolist()} instead of [0, 2]')


def ops_run_problem(devices) -> Optional[str]:
    """One line on why mmcv's ops do not run on ``devices`` under this torch, or None when they do."""
    for device in devices:
        try:
            run_nms(device)
        except Exception as e:  # noqa: BLE001  (whatever the broken build raises)
            problem = mmcv_ops_problem(e)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            return problem or f"mmcv's nms fails on {device} ({type(e).__name__}: {first}): {MMCV_REBUILD}"
    return None


# --- the engine layers' Triton kernels against the ATen backend (where torch sees a GPU) ----------------------
# Each compared tensor (output, input gradient, parameter gradient, buffer) is held to max |Triton - ATen| /
# max |ATen| <= TOLERANCE of its own dtype (against its own scale: a gradient's scale is not the output's).
# float32: both backends compute the same float32 formulas, in other orders of summation (tree sums over up to
# N H W = 30400 values at the detector shape): a few 1e-6 at most (measured in Triton's interpreter at
# 2x8x100x152: <= 2.3e-6, parameter gradients; outputs and dx ~2e-7). 1e-4 leaves a 40x margin, and catches what a
# kernel bug does (a wrong channel's parameter, a missed tail, a stale kept launch: 1e-2 to 1 of the scale).
# bfloat16, the AMP case (float32 layers, a bf16 input under torch.autocast, as mmdet trains): statistics,
# parameter gradients and buffers stay float32 (held to 1e-4), y and dx are bf16: each backend rounds them to
# bf16 once or twice, each rounding up to half an ulp (2^-8 of the value): about one ulp of the scale apart
# (measured 0.005-0.0072 <= 2^-7, same shape). 2^-5 (4 ulps) leaves a 4x margin, far below a bug's 1e-2 to 1.
TOLERANCE = {'float32': 1e-4, 'bfloat16': 2.0 ** -5}
# what main checks on a GPU: FPN's P3 of two 800x1216 images (stride 8), mmdet's GN groups, two training calls
# per backend (the second through the launchers the first kept: kernels/launch.py), then `repeats` timed ones
ENGINE_SETUP = dict(shape=(2, 256, 100, 152), groups=32, dtypes=('float32', 'bfloat16'), calls=2, repeats=20)
ENGINE_LAYERS = ('BCN estimate', 'BCN batch', 'GN+PN', 'Unitization')
KINDS = ('out', 'dx', 'dparams', 'buffers')


class LayerCheck(NamedTuple):
    """One layer in one dtype on both backends: per kind of tensor (``KINDS``) its worst (difference, tolerance,
    tensor name, call); ms per forward + backward (Triton, ATen, nn.GroupNorm; None: not timed); the last
    Triton call's launches (all, kept: through a kept launcher); or the error a backend raised."""
    name: str
    device: str
    dtype: str
    diffs: dict
    ms: tuple = (None, None, None)
    launches: tuple = (0, 0)
    error: Optional[str] = None

    def worst(self):
        return max(self.diffs.values(), key=lambda d: _ratio(d[0], d[1]))


def engine_layers(channels: int, groups: int) -> dict:
    """The engine layers the check runs (float32, training mode), by their report name."""
    from normdense.layers import BatchChannelNorm2d, GroupProxyNorm, Unitization2d
    return {'BCN estimate': BatchChannelNorm2d(channels, groups, update_rate=0.1),
            'BCN batch': BatchChannelNorm2d(channels, groups, mode='batch'),
            'GN+PN': GroupProxyNorm(channels, groups), 'Unitization': Unitization2d(channels)}


def _randomized(layer, gen):
    """``layer`` with parameters and buffers off their initial values: ones, zeros and Unitization's alpha 0
    would hide a kernel that reads another channel's parameter or drops a term."""
    import torch
    with torch.no_grad():
        for t in layer.parameters():
            t.add_(torch.randn(t.shape, generator=gen) * 0.3)
        if hasattr(layer, 'running_mean'):
            layer.running_mean.copy_(torch.randn(layer.running_mean.shape, generator=gen) * 0.5)
            layer.running_var.copy_(torch.rand(layer.running_var.shape, generator=gen) + 0.5)
    return layer


def _autocast(device, dtype: str):
    """AMP as mmdet runs it for the bfloat16 case (the layer stays float32, its input is bf16), else nothing."""
    import contextlib
    import torch
    return torch.autocast(device.type, dtype=torch.bfloat16) if dtype == 'bfloat16' else contextlib.nullcontext()


def run_backend(layer, backend: str, x, dy, dtype: str, calls: int = 2):
    """A copy of ``layer`` on ``backend`` and x's device, ``calls`` training calls (the forward under the dtype's
    autocast, backward of dy): (the module, [{tensor name: value} per call], (launches, kept launches) of the
    last call)."""
    import copy
    from normdense.kernels.launch import counting
    mod = copy.deepcopy(layer).to(x.device).train()
    mod.backend = backend
    results = []
    for _ in range(calls):
        mod.zero_grad(set_to_none=True)
        xi = x.detach().clone().requires_grad_()
        with counting() as launches:
            with _autocast(x.device, dtype):
                y = mod(xi)
            y.backward(dy)
        results.append({'output': y.detach(), 'input grad': xi.grad,
                        **{f'grad of {n}': p.grad for n, p in mod.named_parameters()},
                        **{f'buffer {n}': b.detach().clone() for n, b in mod.named_buffers()}})
    return mod, results, (launches[0], launches[0] - launches[1])


def difference(a, b) -> float:
    """max |a - b| / max |b| (b: ATen's): 0 where they are equal (integer buffers, zeros), inf where they cannot
    agree (one missing, another shape or dtype, a NaN or inf in one only, integers apart)."""
    import torch
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return 0.0 if a is None and b is None else math.inf
    if torch.equal(a, b):
        return 0.0
    if not a.is_floating_point():
        return math.inf
    a, b = a.double(), b.double()
    gap = (a - b).abs().nan_to_num(nan=math.inf).max().item()
    scale = b.abs().nan_to_num(nan=0.0, posinf=0.0).max().item()
    return gap / scale if scale > 0 else math.inf


def compare(triton_results, aten_results) -> dict:
    """{kind: (difference, tolerance, tensor name, call)}, each kind's worst against its tolerance over the calls."""
    diffs = {}
    for call, (tri, aten) in enumerate(zip(triton_results, aten_results), 1):
        for name in sorted(aten.keys() | tri.keys()):
            ref = aten.get(name, tri.get(name))
            tol = TOLERANCE.get(str(ref.dtype).split('.')[-1], 0.0) if ref is not None else 0.0
            d = difference(tri.get(name), aten.get(name))
            kind = {'output': 'out', 'input grad': 'dx'}.get(name, 'dparams' if name.startswith('grad') else 'buffers')
            if kind not in diffs or _ratio(d, tol) > _ratio(*diffs[kind][:2]):
                diffs[kind] = (d, tol, name, call)
    return diffs


def _ratio(d: float, tol: float) -> float:
    return d / tol if tol else (0.0 if d == 0 else math.inf)


def time_step(module, x, dy, dtype: str, repeats: int) -> float:
    """ms per training forward + backward of ``module`` on x (gradients set to None before each, as a training
    step's zero_grad), over ``repeats`` calls after those made already (compiles, kept launches, warm caches)."""
    import time
    import torch
    sync = torch.cuda.synchronize if x.device.type == 'cuda' else (lambda: None)
    xi = x.detach().requires_grad_()
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        module.zero_grad(set_to_none=True)
        xi.grad = None
        with _autocast(x.device, dtype):
            y = module(xi)
        y.backward(dy)
    sync()
    return (time.perf_counter() - start) * 1e3 / repeats


def group_norm_ms(x, dy, groups: int, dtype: str, repeats: int) -> float:
    """nn.GroupNorm's ms per forward + backward on x: mmdet's GN (float32, under the dtype's autocast)."""
    import torch
    gn = torch.nn.GroupNorm(groups, x.shape[1]).to(x.device)
    with _autocast(x.device, dtype):
        out_dtype = gn(x).dtype  # a warm-up call; under autocast group_norm returns float32
    return time_step(gn, x, dy.to(out_dtype), dtype, repeats)


def check_layer(name: str, layer, x, dy, dtype: str, calls: int = 2, repeats: int = 0, gn_ms=None) -> LayerCheck:
    """``layer`` (float32) on the ATen and Triton backends with input x and output gradient dy (on the device to
    check, in ``dtype``): their differences, and with ``repeats`` their times."""
    runs, ms = {}, {}
    for backend in ('aten', 'triton'):
        try:
            runs[backend] = run_backend(layer, backend, x, dy, dtype, calls)
            ms[backend] = time_step(runs[backend][0], x, dy, dtype, repeats) if repeats else None
        except Exception as e:  # noqa: BLE001  (a compile or launch failure, whatever it raises)
            first = (str(e).splitlines() or [type(e).__name__])[0]
            return LayerCheck(name, x.device.type, dtype, {}, error=f'{name} with backend={backend!r} fails on '
                              f'{x.device.type} in {dtype} ({type(e).__name__}: {first})')
    return LayerCheck(name, x.device.type, dtype, compare(runs['triton'][1], runs['aten'][1]),
                      (ms['triton'], ms['aten'], gn_ms), runs['triton'][2])


def problem(check: LayerCheck) -> Optional[str]:
    """One line naming the layer when its Triton kernels fail, or differ from ATen beyond a tolerance; else None."""
    if check.error:
        return check.error
    d, tol, what, call = check.worst()
    if d <= tol:
        return None
    return (f'{check.name}: the Triton kernels differ from the ATen backend on {check.device} ({check.dtype}, '
            f'call {call}, {what}) by {d:.3g} of its largest value (tolerance {tol:.3g})')


def report_line(check: LayerCheck) -> str:
    """The layer's line: its worst difference per kind, the verdict, ms per forward + backward, kept launches."""
    if check.error:
        return f'    {check.name:<13} {check.dtype:<9} FAIL: {check.error}'
    diffs = ''.join(f'{k} {check.diffs[k][0]:<9.2g}' if k in check.diffs else ' ' * 10 for k in KINDS)
    tri, aten, gn = check.ms
    times = '' if tri is None else f'  ms: triton {tri:.3g}, aten {aten:.3g}' + (
        f', nn.GroupNorm {gn:.3g} (triton {tri / gn:.2f}x GN)' if gn else '')
    total, kept = check.launches
    verdict = 'ok' if problem(check) is None else 'FAIL'
    return f'    {check.name:<13} {check.dtype:<9} {diffs}{verdict:<4}{times}  {kept}/{total} launches kept'


def engine_checks(device, shape=(2, 64, 37, 45), groups: int = 8, dtypes=('float32', ), calls: int = 2,
                  repeats: int = 0, layers=ENGINE_LAYERS):
    """Yields a :class:`LayerCheck` for each of ``layers`` in each dtype on ``device`` (x of ``shape``, ``groups``
    groups): 'cuda', or 'cpu' under TRITON_INTERPRET=1 (the tests)."""
    import torch
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(shape, generator=gen) * 2 + 1).to(device)
    grad = torch.randn(shape, generator=gen).to(device)
    built = engine_layers(shape[1], groups)
    for dtype in dtypes:
        x, dy = base.to(getattr(torch, dtype)), grad.to(getattr(torch, dtype))
        gn_ms = group_norm_ms(x, dy, groups, dtype, repeats) if repeats else None
        for name in layers:
            yield check_layer(name, _randomized(built[name], gen), x, dy, dtype, calls, repeats, gn_ms)


def engine_problem(device, out=None, **setup) -> Optional[str]:
    """:func:`engine_checks` (``setup``: its arguments), one :func:`report_line` each to ``out`` (a print function;
    None: silent): the first :func:`problem`, or None when all agree."""
    first = None
    for check in engine_checks(device, **setup):
        if out is not None:
            out(report_line(check))
        first = first or problem(check)
    return first


def triton_step_problem(device: str) -> Optional[str]:
    """One line on why normdense's Triton kernels do not give the ATen backend's result for one training step
    (forward, backward, buffers) of BCN (estimate and batch mode), GN+PN and Unitization on ``device``
    ('cuda'; 'cpu' only under TRITON_INTERPRET=1), or None when they do (float32, 2x64x37x45)."""
    return engine_problem(device, calls=1)


def engine_target(gpu: bool, triton_version: str):
    """(the device the engine check runs on, None), or (None, why it is skipped)."""
    if not gpu:
        return None, 'torch sees no GPU (the layers take the ATen backend on the CPU)'
    if triton_version == 'not installed':
        return None, 'triton is not installed (the layers take the ATen backend)'
    return 'cuda', None


def ops_device(gpu_available: bool, mmcv_cuda: Optional[str]) -> str:
    if mmcv_cuda is None:
        return 'none (mmcv-lite or built without ops)'
    if mmcv_cuda == NO_CUDA:
        return 'CPU only' + (' (GPU present!)' if gpu_available else '')
    return f'CPU + CUDA {mmcv_cuda}' + ('' if gpu_available else ' (no GPU visible)')


def _version(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (e.g. torchvision built for another torch): report, go on
        if isinstance(e, ModuleNotFoundError) and e.name == module_name:
            return 'not installed'
        return f'installed, import fails: {type(e).__name__}: {(str(e).splitlines() or [""])[0][:120]}'
    version = getattr(module, '__version__', None)
    return version or importlib.metadata.version(module_name)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--all', action='store_true',
                        help='also fail unless mmdet, mmseg, mmpretrain, pycocotools and the [deploy] extra import (make install)')
    args = parser.parse_args(argv)
    import torch
    import mmcv
    import mmengine
    import normdense

    gpu = torch.cuda.is_available()
    problem, no_ops = None, False
    try:
        from mmcv.ops import get_compiling_cuda_version
        mmcv_cuda = get_compiling_cuda_version()
    except ImportError as e:  # mmcv-lite (no mmcv._ext), or undefined symbols of a build for another torch
        mmcv_cuda = None
        no_ops = isinstance(e, ModuleNotFoundError) and e.name == 'mmcv._ext'
        problem = mmcv_ops_problem(e) or f'mmcv.ops does not import ({e}): {MMCV_REBUILD}'
    rows = [('python', sys.version.split()[0]),
            ('torch', f'{torch.__version__} (CUDA {torch.version.cuda}, GPU {"yes" if gpu else "no"})'),
            ('torchvision', _version('torchvision')),
            ('mmcv', f'{mmcv.__version__} (ops: {ops_device(gpu, mmcv_cuda)})'),
            ('mmengine', mmengine.__version__),
            # optional codebases (extras det / seg / pretrain)
            ('mmdet', _version('mmdet')), ('mmseg', _version('mmseg')), ('mmpretrain', _version('mmpretrain')),
            ('pycocotools', _version('pycocotools')), ('triton', _version('triton')),
            # ONNX export (extra deploy)
            ('onnx', _version('onnx')), ('onnxruntime', _version('onnxruntime')), ('onnxscript', _version('onnxscript')),
            ('normdense', normdense.__version__)]
    print('normdense self-check: the core stack imports')
    for name, version in rows:
        print(f'  {name:<16} {version}')
    needs_ops = [name for name in ('mmdet', 'mmseg') if dict(rows)[name] != 'not installed']
    if no_ops:
        # mmcv-lite: enough for normdense's layers, not for mmdet / mmseg (or make install)
        problem = (f"{' and '.join(needs_ops) or 'make install'} need{'s' if len(needs_ops) == 1 else ''} "
                   f"mmcv's compiled ops, missing here ({MMCV_NO_OPS})" if needs_ops or args.all else None)
    elif mmcv_cuda is not None:
        problem = (cuda_ops_problem(gpu, torch.version.cuda, mmcv_cuda)
                   or ops_run_problem(['cpu'] + (['cuda'] if gpu and mmcv_cuda != NO_CUDA else [])))
    # the backend 'auto' picks for CUDA tensors, against ATen (without triton or a GPU, auto is ATen)
    device, skipped = engine_target(gpu, dict(rows)['triton'])
    if device is None or problem:
        print(f"  {'Triton kernels':<16} skipped: {skipped or 'fix the failure below first'}")
    else:
        setup = ENGINE_SETUP
        print(f"  {'Triton kernels':<16} against ATen at {'x'.join(map(str, setup['shape']))}, {setup['calls']} "
              "training calls each (bfloat16: float32 layers under autocast): max |Triton - ATen| / max |ATen| of "
              "out, dx, parameter grads, buffers; ms per forward + backward (compiling first)", flush=True)
        try:
            triton_problem = engine_problem(device, **setup, out=functools.partial(print, flush=True))
        except Exception as e:  # noqa: BLE001  (outside a layer's run: the input, nn.GroupNorm; out of memory)
            triton_problem = f'the Triton check could not run ({type(e).__name__}: {(str(e).splitlines() or [""])[0]})'
        print(f"  {'Triton kernels':<16} {'match the ATen backend' if not triton_problem else 'FAIL'}")
        if triton_problem:
            problem = f'{triton_problem}: set NORMDENSE_BACKEND=aten and report it (docs/gpu.md)'
    missing = [name for name, version in rows if name != 'triton'  # optional: auto falls back to ATen
               and (version == 'not installed' or version.startswith('installed, import'))]
    if args.all and missing and not problem:
        problem = (f'not installed or failing to import: {", ".join(missing)} (make install installs them; '
                   'FORCE=1 make install)')
    if problem:
        print(f'normdense self-check FAILED: {problem}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
