"""Bitwise A/B of the engine layers' results between two checkouts: what a refactor of the engine must leave equal.

    cd /tmp && NORMDENSE_LAYERS_ONLY=1 PYTHONPATH=../old python /path/to/benchmarks/bitwise_dump.py dump a.pt
    cd /tmp && NORMDENSE_LAYERS_ONLY=1 PYTHONPATH=../new python /path/to/benchmarks/bitwise_dump.py dump b.pt
    python benchmarks/bitwise_dump.py compare a.pt b.pt

``dump`` runs 3 training steps (forward, backward of a seeded dy) and an eval call of 7 engine configurations x
the ATen and Triton backends (Triton under its interpreter on the CPU) x float64/float32 x NCHW, channels_last
and (N, C, L) inputs, and saves every output (with its strides), input and parameter gradient and buffer.
``compare`` lists what differs (``torch.equal``; strides apart). Run it from outside a checkout, with PYTHONPATH
naming the one to import.
"""
import os
import sys

os.environ.setdefault('TRITON_INTERPRET', '1')  # before triton's kernels are defined

import torch  # noqa: E402

C = 8


def cases():
    from normdense.layers.bcn import BatchChannelNorm2d
    from normdense.layers.proxy_norm import GroupProxyNorm
    from normdense.layers.unitization import Unitization2d
    return {
        'bcn-estimate': lambda b: BatchChannelNorm2d(C, 4, update_rate=0.3, backend=b),
        'bcn-batch': lambda b: BatchChannelNorm2d(C, 4, mode='batch', group_affine=False, backend=b),
        'gnpn-relu': lambda b: GroupProxyNorm(C, 4, backend=b),
        'gnpn-gelu': lambda b: GroupProxyNorm(C, 2, act='gelu', backend=b),
        'unitization-batch': lambda b: Unitization2d(C, backend=b),
        'unitization-estimate': lambda b: Unitization2d(C, mode='estimate', update_rate=0.3, backend=b),
        'unitization-keras': lambda b: Unitization2d(C, norm_divisor='hw_squared', var_correction='keras',
                                                     momentum=None, backend=b),
    }


def dump(path):
    out = {}
    for name, make in cases().items():
        for backend in ('aten', 'triton'):
            for dtype in (torch.float64, torch.float32):
                for layout in ('nchw', 'channels_last', 'ncl'):
                    torch.manual_seed(0)
                    layer = make(backend).to(dtype)
                    with torch.no_grad():
                        for p in layer.parameters():
                            p.add_(torch.randn_like(p) * 0.3)
                    res = []
                    for step in range(3):
                        g = torch.Generator().manual_seed(step)
                        shape = (3, C, 5) if layout == 'ncl' else (3, C, 4, 5)
                        x = torch.randn(shape, generator=g, dtype=dtype) * 2 + 1
                        if layout == 'channels_last':
                            x = x.contiguous(memory_format=torch.channels_last)
                        x.requires_grad_()
                        y = layer(x)
                        y.backward(torch.randn(y.shape, generator=g, dtype=dtype))
                        res += [y.detach(), y.stride(), x.grad] + [p.grad.clone() for p in layer.parameters()]
                        res += [b.clone() for b in layer.buffers()]
                        for p in layer.parameters():
                            p.grad = None
                    with torch.no_grad():
                        res.append(layer.eval()(x.detach()))
                    out[(name, backend, str(dtype), layout)] = res
    torch.save(out, path)
    print(f'{len(out)} runs, {sum(len(v) for v in out.values())} entries -> {path}')


def compare(path_a, path_b):
    a, b = torch.load(path_a, weights_only=False), torch.load(path_b, weights_only=False)
    assert a.keys() == b.keys(), 'the two dumps hold different runs'
    total = values = strides = 0
    for key in a:
        for i, (u, v) in enumerate(zip(a[key], b[key])):
            total += 1
            if isinstance(u, tuple):
                if u != v:
                    strides += 1
                    print('strides', key, i, u, v)
            elif not (u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v)):
                values += 1
                print('values', key, i)
    print(f'{total} entries: {values} values differ, {strides} strides differ')
    return values


if __name__ == '__main__':
    if sys.argv[1:2] == ['dump'] and len(sys.argv) == 3:
        dump(sys.argv[2])
    elif sys.argv[1:2] == ['compare'] and len(sys.argv) == 4:
        sys.exit(1 if compare(sys.argv[2], sys.argv[3]) else 0)
    else:
        sys.exit(__doc__)
