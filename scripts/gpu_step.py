"""One training step (forward + backward) of each Triton-backed layer with ``backend='triton'`` on CUDA: the
program scripts/gpu_check.sh runs under ``compute-sanitizer --tool memcheck``.

    PYTHONPATH=. python scripts/gpu_step.py            # BCN estimate, BCN batch, GN+PN relu, Unitization batch
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/gpu_step.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/gpu_step.py --one   # BCN estimate, bf16, odd shape

Two shapes per layer: one with odd tails (channels per group, H x W not multiples of any block size) and a
P5-sized FPN map. Without PyTorch's caching allocator (the variable above) every tensor is its own device
allocation, so memcheck sees an out-of-bounds access as one, not as a read of a neighbour in the same pool.
Prints one line per step; exits 1 with one line when it cannot run (no GPU, no kernels) or a step fails.
"""
import importlib.util
import os
import sys

if not all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')):
    # a torch-only GPU machine: the layers need neither (normdense/compat.py)
    os.environ.setdefault('NORMDENSE_LAYERS_ONLY', '1')

import torch

SHAPES = [(2, 96, 13, 17), (2, 256, 25, 38)]


def layers(c):
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    return {'BCN estimate': lambda: BatchChannelNorm2d(c, 32, mode='estimate', update_rate=0.1, backend='triton'),
            'BCN batch': lambda: BatchChannelNorm2d(c, 32, mode='batch', backend='triton'),
            'GN+PN relu': lambda: GroupProxyNorm(c, 32, act='relu', backend='triton'),
            'Unitization batch': lambda: Unitization2d(c, backend='triton')}


def main():
    if not torch.cuda.is_available():
        sys.exit('gpu_step.py: no GPU (torch.cuda.is_available() is False)')
    if os.environ.get('TRITON_INTERPRET') == '1':
        sys.exit('gpu_step.py: TRITON_INTERPRET=1 is set: unset it so that the kernels run compiled on the GPU')
    try:
        from normdense.kernels.backend import selected_backend
    except ImportError as e:
        sys.exit(f'gpu_step.py: the Triton backend does not import: {e}')
    one = sys.argv[1:] == ['--one']  # racecheck is slow: the first step alone
    if sys.argv[1:] and not one:
        sys.exit(f'gpu_step.py: unknown arguments {sys.argv[1:]} (usage: gpu_step.py [--one])')
    failed = 0
    for shape in SHAPES[:1] if one else SHAPES:
        for dtype in (torch.bfloat16, ) if one else (torch.bfloat16, torch.float32):
            for name, make in list(layers(shape[1]).items())[:1] if one else layers(shape[1]).items():
                what = f'{name} {"x".join(map(str, shape))} {str(dtype)[6:]}'
                try:
                    module = make().cuda().train()
                    x = (torch.randn(shape, device='cuda') + 0.5).to(dtype).requires_grad_(True)
                    chosen = selected_backend(module, x)
                    if chosen != 'triton':
                        raise RuntimeError(f'selected_backend() gives {chosen!r}')
                    out = module(x)
                    out.backward(torch.randn_like(out))
                    torch.cuda.synchronize()
                    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(x.grad).all())
                    if not finite:
                        raise RuntimeError('output or input gradient not finite')
                    print(f'ok      {what}', flush=True)
                except Exception as e:  # report every step, then fail
                    failed += 1
                    print(f'FAILED  {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ""}',
                          flush=True)
    if failed:
        sys.exit(f'gpu_step.py: {failed} step(s) failed')


if __name__ == '__main__':
    main()
