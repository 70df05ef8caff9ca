"""Import the whole stack normdense runs on, print its versions, and run one of mmcv's ops (the last step
of `make install`; also `python -m normdense.self_check` in any environment). Where torch sees a GPU and
triton imports, one training step of each Triton-backed layer runs against the ATen backend.

Exit status 1, with one line naming the fix, when mmcv's ops do not import or run under the installed torch
(a wheel built for another torch, e.g. from pip's cache: ``nms`` is run on a tiny CPU tensor, and on CUDA
where torch sees a GPU), when torch sees a CUDA GPU but mmcv's ops were compiled without CUDA (RoIAlign,
NMS, ... would fail on the GPU) or for another CUDA major version, and when mmdet or mmseg (which need the
ops) meet mmcv-lite. mmcv-lite alone passes: normdense's layers need no op.
"""
import importlib
import sys
from typing import Optional

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


def triton_step_problem(device: str) -> Optional[str]:
    """One line on why normdense's Triton kernels do not give the ATen backend's result for one training step
    (forward, backward, buffers) of BCN (estimate and batch mode), GN+PN and Unitization on ``device``
    ('cuda'; 'cpu' only under TRITON_INTERPRET=1), or None when they do (float32, rtol 1e-4)."""
    import copy
    import torch
    from normdense.layers import BatchChannelNorm2d, GroupProxyNorm, Unitization2d
    layers = {'BCN estimate': BatchChannelNorm2d(64, 8, update_rate=0.1),
              'BCN batch': BatchChannelNorm2d(64, 8, mode='batch'),
              'GN+PN': GroupProxyNorm(64, 8), 'Unitization': Unitization2d(64)}
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 64, 37, 45, generator=gen) * 2 + 1).to(device)
    dy = torch.randn(2, 64, 37, 45, generator=gen).to(device)
    for name, layer in layers.items():
        results = []
        for backend in ('aten', 'triton'):
            mod = copy.deepcopy(layer).to(device).train()
            mod.backend = backend
            xi = x.clone().requires_grad_()
            try:
                y = mod(xi)
                y.backward(dy)
            except Exception as e:  # noqa: BLE001  (a compile or launch failure, whatever it raises)
                first = (str(e).splitlines() or [type(e).__name__])[0]
                return f'{name} with backend={backend!r} fails on {device} ({type(e).__name__}: {first})'
            results.append([y, xi.grad] + [p.grad for p in mod.parameters()] + list(mod.buffers()))
        for a, b in zip(*results):
            if a.is_floating_point() and not torch.allclose(a, b, rtol=1e-4, atol=1e-4):
                return (f'{name}: the Triton kernels differ from the ATen backend on {device} by '
                        f'{(a - b).abs().max().item():.3g}')
    return None


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
    if not problem and gpu and dict(rows)['triton'] != 'not installed':
        # the backend 'auto' picks for CUDA tensors: one step against ATen (without triton, auto is ATen)
        triton_problem = triton_step_problem('cuda')
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
