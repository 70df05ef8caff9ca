"""Import the whole stack normdense runs on, print its versions, and check that mmcv's ops match torch's
device (the last step of `make install`; also `python -m normdense.self_check` in any environment).

Exit status 1 when torch sees a CUDA GPU but mmcv's ops were compiled without CUDA (RoIAlign, NMS, ...
would fail on the GPU), or for a CUDA major version other than torch's.
"""
import importlib
import sys
from typing import Optional

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


def ops_device(gpu_available: bool, mmcv_cuda: str) -> str:
    if mmcv_cuda == NO_CUDA:
        return 'CPU only' + (' (GPU present!)' if gpu_available else '')
    return f'CPU + CUDA {mmcv_cuda}' + ('' if gpu_available else ' (no GPU visible)')


def _version(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        return 'not installed'
    version = getattr(module, '__version__', None)
    return version or importlib.metadata.version(module_name)


def main(argv=None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--all', action='store_true',
                        help='also fail unless mmdet, mmseg, mmpretrain and pycocotools import (make install)')
    args = parser.parse_args(argv)
    import torch
    import mmcv
    # fails if mmcv was built without ops or against another torch
    from mmcv.ops import RoIAlign, get_compiling_cuda_version  # noqa: F401
    import mmengine
    import normdense

    gpu = torch.cuda.is_available()
    mmcv_cuda = get_compiling_cuda_version()
    rows = [('python', sys.version.split()[0]),
            ('torch', f'{torch.__version__} (CUDA {torch.version.cuda}, GPU {"yes" if gpu else "no"})'),
            ('torchvision', _version('torchvision')),
            ('mmcv', f'{mmcv.__version__} (ops: {ops_device(gpu, mmcv_cuda)})'),
            ('mmengine', mmengine.__version__),
            # optional codebases (extras det / seg / pretrain)
            ('mmdet', _version('mmdet')), ('mmseg', _version('mmseg')), ('mmpretrain', _version('mmpretrain')),
            ('pycocotools', _version('pycocotools')), ('normdense', normdense.__version__)]
    print('normdense self-check: the core stack imports')
    for name, version in rows:
        print(f'  {name:<16} {version}')
    problem = cuda_ops_problem(gpu, torch.version.cuda, mmcv_cuda)
    missing = [name for name, version in rows if version == 'not installed']
    if args.all and missing and not problem:
        problem = f'not installed: {", ".join(missing)} (make install installs them; FORCE=1 make install)'
    if problem:
        print(f'normdense self-check FAILED: {problem}', file=sys.stderr)
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
