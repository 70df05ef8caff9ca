"""BCN / Unitization ``sync_stats`` with two processes (gloo): on CUDA both ranks share the one GPU (gloo
with CUDA tensors), on the CPU the same test runs with CPU tensors. Each rank sees a different batch (of
different size); the synchronized result must equal one process seeing both batches."""
import pytest
import torch

from tests.cuda import dist_worker
from tests.layers.two_ranks import run_two_ranks

# two spawned interpreters importing the stack take ~1 min on 2 shared CPU cores
DEVICES = [pytest.param('cpu', id='cpu', marks=pytest.mark.slow),
           pytest.param('cuda', id='cuda', marks=pytest.mark.cuda)]


@pytest.mark.parametrize('device', DEVICES)
def test_sync_stats_two_processes_equal_one_process_on_both_batches(device, tmp_path):
    # two fresh interpreters (python -m, one OpenMP thread each, a timeout), as the layer tests' two-rank runs:
    # with torch.multiprocessing.spawn a rank aborted in CI twice (SIGABRT, "terminate called without an
    # active exception") in the full suite, never alone
    ranks = run_two_ranks(tmp_path, 'tests.cuda.dist_worker', device)
    xs = [dist_worker.rank_input(r, 'cpu') for r in (0, 1)]
    split = dist_worker.BATCH[0]
    for name, ref in dist_worker.layers().items():
        assert all(r[name]['device'].startswith(device) for r in ranks)
        x = torch.cat(xs).requires_grad_(True)
        out = ref.train()(x)
        # the sum of both ranks' losses, on the concatenated batch
        weight = torch.cat([dist_worker.loss_weight(out[:split], 0), dist_worker.loss_weight(out[split:], 1)])
        (out * weight).sum().backward()
        for n, b in ref.named_buffers():  # statistics / estimates: identical on both ranks, = one process
            assert torch.equal(ranks[0][name]['buffers'][n], ranks[1][name]['buffers'][n]), (name, n)
            torch.testing.assert_close(ranks[0][name]['buffers'][n], b, rtol=1e-5, atol=1e-6, msg=f'{name} {n}')
        torch.testing.assert_close(torch.cat([r[name]['out'] for r in ranks]), out.detach(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.cat([r[name]['grad_x'] for r in ranks]), x.grad, rtol=1e-4, atol=1e-5)
        for n, p in ref.named_parameters():  # DDP would average these; their sum is the one-process gradient
            torch.testing.assert_close(ranks[0][name]['grads'][n] + ranks[1][name]['grads'][n], p.grad,
                                       rtol=1e-4, atol=1e-4, msg=f'{name} grad {n}')
        if not name.endswith('_reference'):  # the fused path equals the reference path, rank by rank
            for r in ranks:
                other = r[name + '_reference']
                for key in ('out', 'grad_x'):
                    torch.testing.assert_close(r[name][key], other[key], rtol=1e-5, atol=1e-5)
                for key in ('grads', 'buffers'):
                    for n in r[name][key]:
                        torch.testing.assert_close(r[name][key][n], other[key][n], rtol=1e-5, atol=1e-5)
