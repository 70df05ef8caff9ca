"""One rank of tests/layers/test_nn_contracts.py's sync_stats case: a gradient penalty through conv -> batch-mode
BCN with ``sync_stats`` (the all-reduced batch statistics, differentiated twice), fused and reference, over two
gloo processes with unequal batches, in float64.

    python -m tests.layers.dist_penalty_worker RANK INIT_FILE OUT_DIR
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from normdense.layers.bcn import BatchChannelNorm2d

C = 4


def penalty_grads(fused, rank):
    torch.manual_seed(0)  # the same parameters on both ranks
    conv = nn.Conv2d(3, C, 3, padding=1).double()
    layer = BatchChannelNorm2d(C, 2, mode='batch', sync_stats=True, fused=fused).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1 + 2 * rank, 3, 4, 4, generator=g, dtype=torch.float64) * (1 + rank)
    y = layer(conv(x))
    w = torch.randn(y.shape, generator=g, dtype=y.dtype)
    gw, = torch.autograd.grad((y * w).sum(), conv.weight, create_graph=True)
    gw.pow(2).sum().backward()
    return [conv.weight.grad] + [p.grad for p in layer.parameters()]


def main(rank, init_file, out_dir):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        result = {'fused': penalty_grads(True, rank), 'reference': penalty_grads(False, rank)}
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
