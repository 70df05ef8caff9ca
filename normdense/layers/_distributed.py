"""The collectives of the StatNorm layers' ``sync_stats``: per-channel moments all-reduced across processes.

* :func:`synced_batch_moments` / :func:`synced_batch_moments_vjp`: the engine's batch statistics from per-(n, c)
  moments and their hand-written VJP (batch-mode BCN);
* :func:`reference_synced_moments`: the same statistics from x through ``torch.distributed.nn``'s differentiable
  all-reduce (the reference composition; its autograd checks the hand-written VJP, and a process with an empty
  input, which takes this path, pairs with the others' VJP);
* :func:`pack` / :func:`unpack`: count-weighted moments for the estimates' all-reduce (``_estimate.py``).

Every all-reduce sums the count too, so unequal batches are exact and a process without samples joins with 0.
"""
import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def pack(moments, count):
    """(2C + 1): the count-weighted moments and the count, for an all-reduce. ``new_full``, not ``new_tensor``: a
    tensor from Python data is a host-to-device copy (a sync on CUDA)."""
    return torch.cat([moments.flatten() * count, moments.new_full((1, ), count)])


def unpack(sums):
    """(moments (2, C), count tensor) of all-reduced :func:`pack` sums; no samples anywhere: moments 0, and a
    zero rate where they are used (``total > 0``) instead of an ``if`` that reads the value (a sync)."""
    total = sums[-1]
    return sums[:-1].view(2, -1) / total.clamp(min=1), total


def synced_batch_moments(m: torch.Tensor, v: torch.Tensor, positions: int):
    """Per-channel mean and biased variance over every process's batch from the per-(n, c) moments, and the
    count of values per channel (a tensor), in two all-reduces: the squares around the global mean, so no
    E[x^2] - E[x]^2 cancellation. Outside autograd."""
    with torch.no_grad():
        count = m.new_full((1, ), m.shape[0] * positions)  # not new_tensor: no host-to-device copy
        packed = torch.cat([m.sum(0) * positions, count])
        dist.all_reduce(packed)
        total = packed[-1]
        mean = packed[:-1] / total.clamp(min=1)
        d = m - mean
        sq = torch.addcmul(v, d, d).sum(0) * positions
        dist.all_reduce(sq)
        return mean, sq / total.clamp(min=1), total


def synced_batch_moments_vjp(m, mean, count, positions, dm, dv, dmean, dvar):
    """dm, dv plus the VJP of :func:`synced_batch_moments` for (dmean, dvar): the all-reduces of the moment
    gradients, in the order and sizes autograd of the forward's all-reduces issues them (var's C, then the
    packed C + 1), so that a process taking the reference path (an empty input) pairs with them."""
    d = m - mean
    total = count.clamp(min=1)
    g_sq = dvar / total
    dist.all_reduce(g_sq)
    g_mean = dmean - (2 * positions) * g_sq * d.sum(0)  # through sq's (x - mean)
    packed = torch.cat([g_mean / total, g_mean.new_zeros(1)])  # the count's slot: not differentiated
    dist.all_reduce(packed)
    dm = dm + torch.addcmul(positions * packed[:-1], d, g_sq, value=2 * positions)
    return dm, dv + positions * g_sq


def reference_synced_moments(xf: torch.Tensor):
    """Differentiable per-channel mean and biased variance of xf (N, C, H, W; half inputs already float32) over
    every process's batch, and the count (a tensor). Two passes: the squares are summed around the global mean
    (no E[x^2] - E[x]^2 cancellation), at the price of a second all-reduce."""
    from torch.distributed.nn.functional import all_reduce
    dims = [0, 2, 3]
    count = xf.new_full((1, ), xf.numel() // xf.shape[1])  # not new_tensor: no host-to-device copy
    packed = all_reduce(torch.cat([xf.sum(dims), count]))
    total = packed[-1]
    mean = packed[:-1] / total.clamp(min=1)  # every rank empty: 0, not 0/0 (running stats stay)
    sq = all_reduce((xf - mean.view(1, -1, 1, 1)).square().sum(dims))
    return mean, sq / total.clamp(min=1), total
