"""One rank of tests/layers/test_reliability.py's two-process gloo run: layers whose batch is empty on
some or all ranks must still join every collective (a rank that skips one desynchronizes the group: gloo
aborts or pairs the wrong collectives, NCCL hangs) and must not write 0/0 into their statistics.

    python -m tests.layers.dist_empty_worker RANK INIT_FILE OUT_DIR
"""
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.unitization import Unitization2d

C = 8


def rank_batch(rank):
    """Rank 0's batch is empty (a RoI head that got no RoIs), rank 1's is not."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, C, 4, 4, generator=g) * 2 + 1
    return x[:0] if rank == 0 else x


def layers():
    return {'unitization_estimate': Unitization2d(C, mode='estimate', update_rate=0.5, sync_stats=True),
            'bcn_estimate': BatchChannelNorm2d(C, 4, mode='estimate', update_rate=0.5, sync_stats=True),
            'bcn_batch_all_empty': BatchChannelNorm2d(C, 4, mode='batch', sync_stats=True),
            # rank 0 empty (the reference path), rank 1 not (the fused path): their all-reduces must pair
            'bcn_batch_one_empty': BatchChannelNorm2d(C, 4, mode='batch', sync_stats=True)}


def loss_weight(out):
    return torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view(out.shape)


def main(rank, init_file, out_dir):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))  # a rank left waiting fails instead of hanging
    try:
        result = {}
        for name, layer in layers().items():
            x = rank_batch(rank) if name != 'bcn_batch_all_empty' else rank_batch(0)
            x.requires_grad_(True)
            out = layer.train()(x)
            (out * loss_weight(out)).sum().backward()
            result[name] = {n: b.clone() for n, b in layer.named_buffers()}
            result[name].update(out=out.detach(), grad_x=x.grad, **{'grad_' + n: p.grad for n, p in
                                                                     layer.named_parameters()})
        dist.barrier()
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
