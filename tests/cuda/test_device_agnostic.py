"""Runs everywhere (no GPU needed): every layer's training step is free of host synchronization and of
tensors created on the CPU, checked with the detectors of ``tests/cuda/device_checks.py``."""
import pytest
import torch

from normdense.deploy.fuse import fuse
from tests.cuda.device_checks import HostSyncRecorder, fake_cuda, run_on_meta, train_step
from tests.cuda.layer_cases import CASES, case_params, fuse_model


@pytest.mark.parametrize('case', case_params())
def test_training_step_has_no_host_sync(case):
    module = case.build()
    train_step(module, case.input())  # first step outside: EquiConv2d's one-time input-sign check syncs
    with HostSyncRecorder() as rec:
        for _ in range(2):
            train_step(module, case.input(seed=2))
        with torch.no_grad():
            module.eval()(case.input(seed=3))
    unexpected = [e for e in rec.events if not any(k in e[0] for k in case.known_syncs)]
    assert not unexpected, f'{case.name}: host synchronization in the training step:\n{rec.report()}'
    if case.known_syncs:  # the documented exception must be real (else drop it from the case)
        assert rec.events


@pytest.mark.parametrize('case', case_params())
def test_training_step_runs_on_meta_device(case):
    module = case.build()
    if case.name.startswith('EquiConv2d'):
        module._input_sign_checked = True  # the documented one-time check reads a value
    run_on_meta(module, case.input())


def test_recorder_catches_the_patterns_it_claims():
    x = torch.randn(4, 3)
    with HostSyncRecorder() as rec:
        x.sum().item()
        bool((x > 0).any())
        torch.tensor([1.0, 2.0])
        x.new_tensor([3])
        x[x > 0]
        x.nonzero()
        torch.ones(3).repeat_interleave(torch.tensor([1, 2, 3]))
    ops = [e[0] for e in rec.events]
    assert ops.count('_local_scalar_dense') == 2 and ops.count('lift_fresh') == 3
    assert 'index' in ops and 'nonzero' in ops and 'repeat_interleave' in ops
    with HostSyncRecorder() as rec:
        y = x * 2 + torch.zeros_like(x)
        x.new_full((1, ), 3.0)
        torch.ones(3).repeat_interleave(2)
        y.mean(0)
    assert rec.events == [], rec.report()


def test_meta_check_catches_cpu_tensors_and_value_reads():
    class CpuTensor(torch.nn.Module):
        def forward(self, x):
            return x * torch.ones(x.shape[1], 1, 1)

    class ReadsValue(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    x = torch.randn(2, 3, 4, 4)
    for module in (CpuTensor(), ReadsValue()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            run_on_meta(module, x)
    assert len(CASES) > 20


def test_fuse_keeps_everything_on_the_model_device():
    """deploy.fuse on a model whose tensors live on a (fake) CUDA device: every folding step and the fused
    model's forward stay there (it used to build IterNorm's block matrix and a missing conv bias on the CPU)."""
    with fake_cuda(fuse_model().eval()) as model:
        stats = {}
        fused = fuse(model, stats=stats)
        out = fused(torch.randn(2, 16, 9, 9, device='cuda').relu())
        assert out.device.type == 'cuda'
        assert {t.device.type for t in fused.state_dict().values()} == {'cuda'}
    assert stats['folded'] >= 5 and stats['standalone'] >= 2, stats
