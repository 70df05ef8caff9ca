"""One rank of tests/layers/test_estimate_iterations.py's two-process gloo run: estimate-mode layers with
``sync_stats`` trained with and without activation checkpointing (the recomputation must issue no
collective), and fused=False batch-mode BCN with ``sync_stats`` in fp16/bf16 against float32.

    python -m tests.layers.dist_checkpoint_worker RANK INIT_FILE OUT_DIR
"""
import copy
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from normdense.layers import set_update_rate
from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.unitization import Unitization2d

CALLS = [0]


def counted(fn):
    def wrapper(*args, **kwargs):
        CALLS[0] += 1
        return fn(*args, **kwargs)
    return wrapper


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = norm
        self.cp = None

    def inner(self, x):
        return torch.relu(self.norm(self.conv(x)))

    def forward(self, x):
        if self.cp is None:
            return self.inner(x)
        return checkpoint(self.inner, x, use_reentrant=self.cp == 'reentrant')


def norms():
    return {'bcn_fused': BatchChannelNorm2d(8, num_groups=4, mode='estimate', sync_stats=True),
            'bcn_reference': BatchChannelNorm2d(8, num_groups=4, mode='estimate', sync_stats=True, fused=False),
            'unitization_fused': Unitization2d(8, mode='estimate', sync_stats=True),
            'unitization_reference': Unitization2d(8, mode='estimate', sync_stats=True, fused=False)}


def train(model, rank):
    g = torch.Generator().manual_seed(10 + rank)  # each rank its own images
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = []
    CALLS[0] = 0
    for _ in range(3):
        set_update_rate(model, 0.3)
        x = (torch.randn(2, 3, 6, 6, generator=g, dtype=torch.float64) * 2 + rank).requires_grad_(True)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        grads.append(model.conv.weight.grad.clone())
        opt.step()
    return dict(grads=grads, buffers=[b.clone() for b in model.norm.buffers()], collectives=CALLS[0])


def half_case(rank):
    """fused=False batch-mode BCN with sync_stats: 2 x 60800 values per channel (fp16's max is 65504), in
    fp16/bf16 under autocast and, as the reference, in float32 on the same (rounded) values."""
    g = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(2, 8, 160, 190, generator=g) * 0.5 + 3.0
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        xh = x.to(dtype)
        for key, inp, enabled in (('half', xh, True), ('float32', xh.float(), False)):
            layer = BatchChannelNorm2d(8, num_groups=4, mode='batch', sync_stats=True, fused=False).train()
            with torch.autocast('cpu', dtype=dtype, enabled=enabled):
                y = layer(inp)
            out[(str(dtype).split('.')[1], key)] = dict(output=y.float()[:, :, :8, :8].clone(),
                                                        running_mean=layer.running_mean.clone(),
                                                        running_var=layer.running_var.clone())
    return out


def main(rank, init_file, out_dir):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # a rank left waiting fails instead of hanging
    dist.all_reduce = counted(dist.all_reduce)
    try:
        result = {'checkpoint': {}}
        for name, norm in norms().items():
            plain = Block(norm).double()
            runs = {}
            for cp in (None, 'reentrant', 'non_reentrant'):
                model = copy.deepcopy(plain)
                model.cp = cp
                runs[cp or 'plain'] = train(model, rank)
            result['checkpoint'][name] = runs
        result['half'] = half_case(rank)
        dist.barrier()
        torch.save(result, f'{out_dir}/rank{rank}.pth')
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
