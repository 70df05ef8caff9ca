"""One rank of tests/kernels/test_triton_backend.py's two-process gloo run: the layers with ``sync_stats`` on
the Triton backend (the statistics' all-reduces between the kernels) against the same layers on ATen, rank
by rank, including a rank whose batch is empty (it takes the reference path; the all-reduces must pair).

    python -m tests.kernels.dist_triton_worker RANK INIT_FILE OUT_DIR DEVICE   (cpu: TRITON_INTERPRET=1; cuda: both
                                                                              ranks on the one GPU, gloo)
"""
import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.unitization import Unitization2d
from tests.kernels.launches import count_launches

C = 8


def layers():
    return {'bcn_batch': BatchChannelNorm2d(C, 4, mode='batch', sync_stats=True),
            'bcn_estimate': BatchChannelNorm2d(C, 4, mode='estimate', update_rate=0.5, sync_stats=True),
            'unitization_estimate': Unitization2d(C, mode='estimate', update_rate=0.5, sync_stats=True),
            'bcn_batch_rank0_empty': BatchChannelNorm2d(C, 4, mode='batch', sync_stats=True)}


def rank_batch(rank, name):
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(2 + rank, C, 5, 7, generator=g, dtype=torch.float64) * 2 + 1
    return x[:0] if name.endswith('rank0_empty') and rank == 0 else x


def main(rank, init_file, out_dir, device):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails instead of hanging
    try:
        result = {}
        for name, layer in layers().items():
            torch.manual_seed(0)
            layer = layer.double().to(device).train()
            with torch.no_grad():
                for p in layer.parameters():
                    p.add_(torch.randn_like(p) * 0.3)
            for backend in ('aten', 'triton'):
                mod = copy.deepcopy(layer)
                mod.backend = backend
                outs = {}
                with count_launches() as launches:
                    for step in range(2):
                        x = rank_batch(rank, name).to(device).requires_grad_(True)
                        out = mod(x)
                        loss = (out * torch.linspace(-1, 2, out.numel(), dtype=out.dtype, device=device).view(out.shape)).sum()
                        loss.backward()
                        outs[f'out{step}'], outs[f'grad_x{step}'] = out.detach().cpu(), x.grad.cpu()
                outs['triton_launches'] = launches['triton']
                outs.update({n: b.cpu() for n, b in mod.named_buffers()})
                outs.update({'grad_' + n: p.grad.cpu() for n, p in mod.named_parameters()})
                result[f'{name}/{backend}'] = outs
        dist.barrier()
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
