"""The engine's backward as an autograd graph: what ``_StatNormFn.backward`` runs when the gradients it returns must
themselves be differentiable (``create_graph=True``: a gradient penalty, ``gradgradcheck``) or carry a batch of
cotangents (``autograd.grad(is_grads_batched=True)``, ``jacobian(vectorize=True)``). The closed-form passes write
into buffers (ATen's ``out=`` kernels, Triton) that neither autograd nor vmap can see through, so this path
recomputes the call's forward from its saved input with the layer's torch coefficient map and plain torch ops, and
lets autograd differentiate that. The statistics are those of the forward: constants where the forward treated
them as such (eval's running statistics, estimate mode's estimates, fixed within an iteration), the batch's as
functions of x in batch mode (all-reduced differentiably with ``sync_stats``). Values equal the closed form's to
round-off (tests/layers/test_nn_contracts.py)."""
from typing import Optional

import torch

from ..kernels.backend import Statistics, ncl


def tensor_stats(stats: Statistics) -> Statistics:
    """``stats`` with tensors for mean and var (a deferred first stage, the Triton path, gives their addresses)."""
    if stats.first is None:
        return stats
    o = stats.first.outputs
    return stats._replace(mean=o.mean, var=o.var, update=o.update, first=None)


def _synced_moments(m: torch.Tensor, v: torch.Tensor, positions: int):
    """(mean, biased variance, count) over every process from the per-(n, c) moments, differentiable: the engine's
    ``synced_batch_moments`` through torch.distributed.nn's all-reduce (every process joins both)."""
    from torch.distributed.nn.functional import all_reduce
    count = m.new_full((1, ), m.shape[0] * positions)
    packed = all_reduce(torch.cat([m.sum(0) * positions, count]))
    total = packed[-1].detach()
    mean = packed[:-1] / total.clamp(min=1)
    d = m - mean
    sq = all_reduce(torch.addcmul(v, d, d).sum(0) * positions)
    return mean, sq / total.clamp(min=1), total


def graph_backward(ctx, x: torch.Tensor, dy: torch.Tensor, create_graph: bool):
    """(dx, dparams) of one engine call by autograd of its torch composition, from the Function's saved input
    ``x`` (the layer's input; (N, C, L) on the ATen path): differentiable where ``create_graph``."""
    call = ctx.call
    plan = call.plan
    params = ctx.params
    n, c, length = ncl(x)
    with torch.enable_grad():
        x3 = x.reshape(n, c, length)
        xf = x3 if x3.dtype == plan.cd else x3.to(plan.cd)
        v, m = torch.var_mean(xf, dim=2, correction=0)
        mean = var = None
        count = call.count
        if call.kind == 'fixed':  # constants of this call, as in the forward
            stats = tensor_stats(ctx.stats)
            mean, var = stats.mean.detach().to(plan.cd), stats.var.detach().to(plan.cd)
        elif call.kind == 'batch':  # the law of total variance, as the backends' first stage
            mean = m.mean(0)
            d = m - mean
            var = torch.addcmul(v, d, d).mean(0)
        elif call.kind == 'synced':
            mean, var, count = _synced_moments(m, v, length)
        coeffs, _ = plan.torch_maps.coeff_map(m, v, mean, var, params, length, count)
        y = torch.addcmul(coeffs[1].unsqueeze(2), coeffs[0].unsqueeze(2), xf - m.unsqueeze(2))
        if plan.activation is not None:  # GN+PN: y = K act(A t + B) + L'
            y = torch.addcmul(coeffs[3].unsqueeze(2), coeffs[2].unsqueeze(2), plan.activation.forward(y))
        y = y.to(plan.out_dtype)
        wanted = [x] if ctx.needs_input_grad[0] else []
        slots = [i for i, p in enumerate(params) if p is not None and ctx.needs_input_grad[4 + i]]
        wanted += [params[i] for i in slots]
        grads = torch.autograd.grad(y, wanted, dy.reshape(n, c, length).to(y.dtype), create_graph=create_graph,
                                    allow_unused=True) if wanted else ()
    dx: Optional[torch.Tensor] = grads[0] if ctx.needs_input_grad[0] else None
    dparams = [None] * len(params)
    for i, g in zip(slots, grads[len(wanted) - len(slots):]):  # unused: a parameter y does not depend on
        dparams[i] = g if g is not None else torch.zeros_like(params[i])
    return dx, dparams
