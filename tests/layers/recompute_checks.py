"""Shared checks of the layers' ``recompute`` option, used by tests/layers/test_{bcn,proxy_norm,iternorm,
unitization}.py."""
import contextlib
import copy
from typing import List

import pytest
import torch
import torch.nn as nn

from benchmarks._timing import saved_activation_bytes as saved_bytes  # the layer benchmark's metric


def activation_bytes_per_element(layer: nn.Module, x: torch.Tensor) -> float:
    """Saved bytes that grow with the input (difference between x and x at twice the height, per input
    element), as the layer benchmark reports them; the rest is weight-sized."""
    x1 = x.detach().clone().requires_grad_(True)
    x2 = torch.cat([x.detach(), x.detach()], dim=2).requires_grad_(True)
    params = list(layer.parameters())
    return (saved_bytes(lambda: layer(x2), params) - saved_bytes(lambda: layer(x1), params)) / x.numel()


def assert_saves_only_the_input(plain: nn.Module, rec: nn.Module, x: torch.Tensor, plain_factor: float):
    """Bytes saved for backward (benchmarks/_timing.py's metric), against an nn.GroupNorm on the same
    input: ``plain`` keeps ``plain_factor`` activation-sized tensors, ``rec`` (recompute on) at most 1.2x
    nn.GroupNorm's, per input element and in total (weight-sized part included)."""
    gn = nn.GroupNorm(8, x.shape[1])
    gn_total = saved_bytes(lambda: gn(x.clone().requires_grad_(True)), list(gn.parameters()))
    gn_act = activation_bytes_per_element(gn, x)
    assert activation_bytes_per_element(plain, x) == pytest.approx(plain_factor * gn_act)
    assert activation_bytes_per_element(rec, x) <= 1.2 * gn_act
    assert saved_bytes(lambda: rec(x.clone().requires_grad_(True)), list(rec.parameters())) <= 1.2 * gn_total


def assert_recompute_matches_plain(layer: nn.Module, inputs: List[torch.Tensor], autocast: bool = False,
                                   eval_before_backward: bool = False):
    """``layer`` (recompute off) and a copy with ``recompute=True``, same state, each called on every
    input within one graph (a shared layer called several times per iteration), one backward: outputs,
    input gradients and every buffer must be identical, every parameter's gradient equal up to float
    rounding, and backward must not touch any buffer (statistics are updated once, in the forward)."""
    assert not layer.recompute
    other = copy.deepcopy(layer)
    other.recompute = True
    assert set(other.state_dict()) == set(layer.state_dict())
    results = []
    for m in (layer, other):
        xs = [x.detach().clone().requires_grad_(True) for x in inputs]
        ctx = torch.autocast('cpu', dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            outs = [m(x) for x in xs]
        buffers = {k: v.clone() for k, v in m.named_buffers()}
        g = torch.Generator().manual_seed(0)
        loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
        if eval_before_backward:
            m.eval()
        loss.backward()
        for k, v in m.named_buffers():
            assert torch.equal(v, buffers[k]), f'backward changed buffer {k}'
        results.append(dict(outs=outs, xgrads=[x.grad for x in xs], buffers=buffers,
                            pgrads={n: p.grad for n, p in m.named_parameters()}))
    ref, rec = results
    for a, b in zip(ref['outs'] + ref['xgrads'], rec['outs'] + rec['xgrads']):
        assert a.dtype == b.dtype and torch.equal(a, b)
    # A parameter used in several places gets one gradient per recomputed call instead of one per use,
    # summed in another order: equal up to float rounding.
    assert ref['pgrads'].keys() == rec['pgrads'].keys()
    for n, gr in ref['pgrads'].items():
        assert gr is not None
        torch.testing.assert_close(rec['pgrads'][n], gr, rtol=1e-5, atol=1e-5 * float(gr.abs().max()), msg=n)
    for k, v in ref['buffers'].items():
        assert torch.equal(v, rec['buffers'][k]), k
    return other
