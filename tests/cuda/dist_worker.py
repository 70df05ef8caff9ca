"""Worker of tests/cuda/test_sync_stats.py: one rank of a two-process gloo group (CUDA tensors when
device='cuda', both ranks on the same GPU).

    python -m tests.cuda.dist_worker RANK INIT_FILE OUT_DIR DEVICE
"""
import sys

import torch
import torch.distributed as dist

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.unitization import Unitization2d

BATCH = (2, 3)  # unequal per-rank batches: the synced moments must weight them by count


def rank_input(rank, device, channels=16):
    g = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(BATCH[rank], channels, 5, 4, generator=g, dtype=torch.float64) * (1 + rank) + rank).to(
        device=device, dtype=torch.float32)


def loss_weight(out, rank):
    return torch.linspace(-1, 1 + rank, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)


def layers():
    """Each layer on its fused path (default) and on the reference composition (``_reference``)."""
    torch.manual_seed(0)
    out = {}
    for fused in (True, False):
        suffix = '' if fused else '_reference'
        out.update({
            'bcn_estimate' + suffix: BatchChannelNorm2d(16, 4, mode='estimate', update_rate=0.5, sync_stats=True,
                                                        fused=fused),
            'bcn_batch' + suffix: BatchChannelNorm2d(16, 4, mode='batch', sync_stats=True, fused=fused),
            'unitization_estimate' + suffix: Unitization2d(16, mode='estimate', update_rate=0.5, sync_stats=True,
                                                           fused=fused)})
    return out


def run(rank, init_file, device, out_dir):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    try:
        result = {}
        for name, layer in layers().items():
            layer = layer.to(device).train()
            x = rank_input(rank, device).requires_grad_(True)
            out = layer(x)
            (out * loss_weight(out, rank)).sum().backward()
            result[name] = dict(out=out.detach().cpu(), grad_x=x.grad.cpu(),
                                grads={n: p.grad.cpu() for n, p in layer.named_parameters()},
                                buffers={n: b.cpu() for n, b in layer.named_buffers()},
                                device=str(out.device))
        # no rank tears the group down while the other is still in a collective (a closed gloo connection
        # aborts the other process: seen once in CI, SIGABRT "terminate called without an active exception")
        dist.barrier()
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    run(int(sys.argv[1]), sys.argv[2], sys.argv[4], sys.argv[3])
