"""IterNorm on CUDA (issue 27): a training step without host synchronization, and the Newton iterations as
batched matrix products over the groups (no per-group Python loop).

Both are checked on the CPU, where they are visible at the ATen dispatcher: ``HostSyncRecorder``
(tests/cuda/device_checks.py) records every op that makes the host wait for a CUDA stream or copies Python
data to the device; the meta-device run catches tensors created on the CPU and values read by paths that
bypass the dispatcher (``.tolist()``, ``.cpu()``); the op count of a training step is the number of kernel
launches on a GPU up to a constant, so it must not depend on the number of groups.
"""
import pytest
import torch
import torch.utils.checkpoint as cp

from benchmarks._timing import count_ops
from normdense.layers.iternorm import IterNorm
from tests.cuda.device_checks import HostSyncRecorder, run_on_meta

# (name, layer factory, input shape, dtype, autocast)
CONFIGS = [
    ('4 groups', lambda: IterNorm(64, group_size=16), (2, 64, 5, 6), torch.float32, False),
    ('last group smaller', lambda: IterNorm(70, group_size=16), (2, 70, 5, 6), torch.float32, False),
    ('one group T=0 no affine', lambda: IterNorm(12, group_size=64, T=0, affine=False), (3, 12, 4, 4),
     torch.float32, False),
    ('recompute', lambda: IterNorm(40, group_size=16, recompute=True), (2, 40, 5, 6), torch.float32, False),
    ('float64', lambda: IterNorm(24, group_size=8).double(), (2, 24, 3, 5), torch.float64, False),
    ('bf16 autocast', lambda: IterNorm(32, group_size=8), (2, 32, 5, 6), torch.float32, True),
    ('(N, C) features', lambda: IterNorm(16, group_size=4), (6, 16), torch.float32, False),
]


def _input(shape, dtype, seed, dead_group=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if dead_group:  # a constant group: its running statistics are left alone (the tensor-condition branch)
        x[:, :16] = 0.5
    return x.to(dtype)


def _step(layer, x, autocast=False, checkpoint=False):
    x = x.detach().requires_grad_(True)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        y = cp.checkpoint(layer, x, use_reentrant=False) if checkpoint else layer(x)
    y.backward(torch.ones_like(y))


@pytest.mark.parametrize('name,factory,shape,dtype,autocast', CONFIGS, ids=[c[0] for c in CONFIGS])
def test_training_step_has_no_host_sync(name, factory, shape, dtype, autocast):
    layer = factory().train()
    _step(layer, _input(shape, dtype, 0), autocast)
    xs = [_input(shape, dtype, seed, dead_group=seed == 2 and shape[1] >= 32) for seed in (1, 2, 3, 4)]
    with HostSyncRecorder() as rec:
        for x in xs[:2]:
            _step(layer, x, autocast)
        _step(layer, xs[2], autocast, checkpoint=True)  # with_cp: the recomputation in backward too
        with torch.no_grad():
            layer.eval()(xs[3])
    assert rec.events == [], f'{name}: host synchronization in IterNorm:\n{rec.report()}'


@pytest.mark.parametrize('name,factory,shape,dtype,autocast', CONFIGS[:5], ids=[c[0] for c in CONFIGS[:5]])
def test_training_step_on_meta_device(name, factory, shape, dtype, autocast):
    run_on_meta(factory(), _input(shape, dtype, 0))


def _ops_per_step(layer, shape):
    x = torch.randn(shape).requires_grad_(True)
    _step(layer, x)  # first call outside the count (nothing lazy happens, but keep it like a benchmark)
    return count_ops(lambda: _step(layer, x))


@pytest.mark.parametrize('recompute', [False, True], ids=['autograd', 'recompute'])
def test_ops_per_step_do_not_grow_with_the_number_of_groups(recompute):
    """1 to 64 groups of 4 channels, and the same with a smaller last group: the same number of ATen ops per
    training step (forward + backward), i.e. one batched computation per group size, whatever the count."""
    equal = {g: _ops_per_step(IterNorm(4 * g, group_size=4, recompute=recompute), (2, 4 * g, 3, 3))
             for g in (1, 4, 16, 64)}
    ragged = {g: _ops_per_step(IterNorm(4 * g + 2, group_size=4, recompute=recompute), (2, 4 * g + 2, 3, 3))
              for g in (1, 4, 16, 64)}
    assert len(set(equal.values())) == 1, equal
    assert len(set(ragged.values())) == 1, ragged
    # the smaller last group is a second batched block: at most twice the work of one
    assert ragged[1] <= 2 * equal[1], (ragged, equal)


def test_newton_products_are_batched_over_groups():
    """A forward of G groups is 3 T - 2 batched matrix products for the Newton steps (the first step needs one:
    P_0 = I), one for the covariance and one for W X_C, each over all groups at once, not one per group."""
    seen = []

    class Bmm(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ('bmm', 'baddbmm', 'mm', 'matmul'):
                seen.append((func.overloadpacket.__name__, tuple(args[0].shape)))
            return func(*args, **(kwargs or {}))

    layer = IterNorm(48, group_size=8, T=5)
    with Bmm(), torch.no_grad():
        layer(torch.randn(2, 48, 4, 4))
    assert seen and all(name in ('bmm', 'baddbmm') and shape[0] == 6 for name, shape in seen), seen
    assert len(seen) == 1 + (3 * 5 - 2) + 1, seen
