"""One rank of tests/layers/test_estimate_sync.py: estimate-mode layers with ``sync_stats`` (the default of
every multi-GPU BCN run) over two gloo processes with unequal batches, in float64, for three iterations.

    python -m tests.layers.dist_estimate_worker RANK INIT_FILE OUT_DIR
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.unitization import Unitization2d

C, RATE, STEPS = 8, 0.3, 3


def rank_batch(rank, step):
    """Rank 0 holds 1 sample, rank 1 holds 3 (unequal: a plain average of the ranks' moments is wrong)."""
    g = torch.Generator().manual_seed(10 * step + rank)
    n = 1 if rank == 0 else 3
    return torch.randn(n, C, 4, 5, generator=g, dtype=torch.float64) * (1 + rank) + 2 * rank - 1


def layers():
    torch.manual_seed(0)
    out = {}
    for fused in (True, False):
        suffix = '' if fused else '_reference'
        out['bcn' + suffix] = BatchChannelNorm2d(C, 4, update_rate=RATE, fused=fused)
        out['unitization' + suffix] = Unitization2d(C, mode='estimate', update_rate=RATE, fused=fused)
    for layer in out.values():
        layer.double()
        with torch.no_grad():  # estimates away from their initial values: variance around them matters
            layer.running_mean.copy_(torch.linspace(-1, 1, C))
            layer.running_var.copy_(torch.linspace(0.5, 2, C))
    return out


def main(rank, init_file, out_dir):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        result = {}
        for name, layer in layers().items():
            layer.train()
            steps = []
            for step in range(STEPS):
                x = rank_batch(rank, step).requires_grad_(True)
                y = layer(x)
                y.sum().backward()  # ends the iteration
                steps.append(dict(y=y.detach(), mean=layer.running_mean.clone(), var=layer.running_var.clone()))
            result[name] = steps
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
