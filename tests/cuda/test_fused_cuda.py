"""The fused path of BCN, GN+PN and Unitization on CUDA: equal to the reference composition (float64, on
the GPU) and to the fused path on the CPU; half inputs finite. Not run without a GPU."""
import pytest
import torch

from tests.layers.test_fused import CASES, assert_same, make, run

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_equals_reference_on_cuda(name):
    fused, ref = make(name)
    cpu = make(name)[0]
    fused, ref = fused.cuda(), ref.cuda()
    torch.manual_seed(3)
    xs = [torch.randn(2, 8, 5, 6, dtype=torch.float64) * 2 + 1, torch.randn(1, 8, 3, 4, dtype=torch.float64)]
    on_gpu = run(fused, [x.cuda() for x in xs])
    assert_same(on_gpu, run(ref, [x.cuda() for x in xs]))
    on_cpu = run(cpu, xs)
    to_cpu = dict(outs=[t.cpu() for t in on_gpu['outs']], xgrads=[t.cpu() for t in on_gpu['xgrads']],
                  pgrads={k: v.cpu() for k, v in on_gpu['pgrads'].items()},
                  buffers={k: v.cpu() for k, v in on_gpu['buffers'].items()})
    assert_same(to_cpu, on_cpu)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('name', sorted(CASES))
def test_fused_half_on_cuda_is_finite(name, dtype):
    fused, _ = make(name, dtype=dtype)
    r = run(fused.cuda(), [torch.randn(2, 8, 16, 16, device='cuda', dtype=dtype) * 2 + 1])
    assert all(torch.isfinite(t).all() for t in r['outs'] + r['xgrads'] + list(r['pgrads'].values()))
