"""The synced estimate update (estimate mode with ``sync_stats`` over several processes) against Algorithm 1
of Qiao et al. (arXiv:1903.10520) on the two processes' batches taken together, in float64: not only rank
against rank (a wrong update applied identically on every rank passes that)."""
import pytest
import torch

from tests.layers import dist_estimate_worker as W
from tests.layers.two_ranks import run_two_ranks


def algorithm1(x, mean, var, rate):
    """Steps 1-4 on the combined batch x (N, C, H, W): batch mean, second moment around the estimate."""
    mu = x.mean((0, 2, 3))
    second = (x - mean.view(1, -1, 1, 1)).square().mean((0, 2, 3))
    return mean + rate * (mu - mean), var + rate * (second - var)


@pytest.mark.slow  # two interpreters: ~30-60 s on 2 shared cores
def test_synced_estimates_follow_algorithm1_on_the_combined_batch(tmp_path):
    ranks = run_two_ranks(tmp_path, 'tests.layers.dist_estimate_worker')
    for name, layer in W.layers().items():
        mean, var = layer.running_mean.clone(), layer.running_var.clone()
        for step in range(W.STEPS):
            batches = [W.rank_batch(r, step) for r in (0, 1)]
            mean, var = algorithm1(torch.cat(batches), mean, var, W.RATE)
            for r in (0, 1):
                got = ranks[r][name][step]
                torch.testing.assert_close(got['mean'], mean, rtol=0, atol=1e-13, msg=f'{name} step {step}')
                torch.testing.assert_close(got['var'], var, rtol=0, atol=1e-13, msg=f'{name} step {step}')
                # and the rank's output is normalized with them (steps 5-8: the updated estimates)
                ref = W.layers()[name].eval()
                with torch.no_grad():
                    ref.running_mean.copy_(mean)
                    ref.running_var.copy_(var)
                    for p, q in zip(ref.parameters(), layer.parameters()):
                        p.copy_(q)
                    expected = ref(batches[r])
                torch.testing.assert_close(got['y'], expected, rtol=0, atol=1e-12, msg=f'{name} step {step}')
