"""The all-reduces of ``sync_stats``: the engine's batch statistics from per-(n, c) moments and their
hand-written VJP, the reference composition's differentiable version (whose autograd checks that VJP), and the
estimates' packed moments. Each sums the count too: exact for unequal batches, 0 from a process without samples.
"""
import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def pack(moments, count):
    """(2C + 1): the count-weighted moments and the count (``new_full``: no host-to-device copy)."""
    return torch.cat([moments.flatten() * count, moments.new_full((1, ), count)])


def unpack(sums):
    """(moments (2, C), count tensor) of all-reduced :func:`pack` sums (moments 0 where no process had samples)."""
    total = sums[-1]
    return sums[:-1].view(2, -1) / total.clamp(min=1), total


def synced_batch_moments(m: torch.Tensor, v: torch.Tensor, positions: int):
    """(mean, biased variance, count tensor) per channel over every process's batch from the per-(n, c) moments,
    outside autograd: two all-reduces, the squares around the global mean (no E[x^2] - E[x]^2 cancellation)."""
    with torch.no_grad():
        count = m.new_full((1, ), m.shape[0] * positions)
        packed = torch.cat([m.sum(0) * positions, count])
        dist.all_reduce(packed)
        total = packed[-1]
        mean = packed[:-1] / total.clamp(min=1)
        d = m - mean
        sq = torch.addcmul(v, d, d).sum(0) * positions
        dist.all_reduce(sq)
        return mean, sq / total.clamp(min=1), total


def synced_batch_moments_vjp(m, mean, count, positions, dm, dv, dmean, dvar):
    """dm, dv plus the VJP of :func:`synced_batch_moments`, all-reducing in the order and sizes autograd of the
    reference path issues (C, then C + 1), so that a process taking it (an empty input) pairs with them."""
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
    """:func:`synced_batch_moments` of xf (N, C, H, W; half inputs as float32), differentiable."""
    from torch.distributed.nn.functional import all_reduce
    dims = [0, 2, 3]
    count = xf.new_full((1, ), xf.numel() // xf.shape[1])
    packed = all_reduce(torch.cat([xf.sum(dims), count]))
    total = packed[-1]
    mean = packed[:-1] / total.clamp(min=1)  # every rank empty: 0, not 0/0 (running stats stay)
    sq = all_reduce((xf - mean.view(1, -1, 1, 1)).square().sum(dims))
    return mean, sq / total.clamp(min=1), total
