"""The second stage of the channel-sized VJP kernels at large N: their per-channel sums over the samples (the
parameter gradients, and dmean, dvar of batch statistics) as partials of SB sample blocks, summed in a fixed
order (deterministic, no atomics).

A layer's VJP kernel runs on a grid of (channel blocks, ..., sample blocks): each program sums over its own
block of ``n_per`` samples and writes one partial row of the flat buffer ``part`` (SB, width). Every quantity
summed this way is linear in the per-sample sums (the closed forms multiply them by per-channel factors), so
a program may apply those factors to its partial. The partials are then summed without a launch of their
own: dx, the backward's last kernel, finishes them (program p of its first chunk takes the FINISH_BLOCK
columns from p * FINISH_BLOCK on and adds the SB rows in order, :func:`finish`; dmean, dvar are added as dx
loads them, ``first_stage.split_sum``). Where no dx runs (the input needs no gradient), or dx has too few
programs, :meth:`BlockSums.finish` sums them in torch.

At detection's N = 1-2 the samples take one iteration: SB = 1, the kernels write the final values directly
and nothing here runs.
"""
import torch
import triton
import triton.language as tl

from .first_stage import split_sum

# columns per dx program finishing the partials (a constexpr: jit code may read no other global); 512: the dx
# variants with the second stage do not spill in float64 (128 did, ptxas -v on sm_90)
FINISH_BLOCK = tl.constexpr(512)


class BlockSums:
    """Where a VJP kernel writes its per-channel sums: the final gradients (SB = 1), or the partials (SB, width)
    of its sample blocks with the final parameter gradients' storage (``out``) that :func:`finish` fills.

    ``params``: the parameters (None where a gradient is not wanted), whose gradients come in their dtypes;
    ``stats``: whether dmean, dvar (C,) are written too (batch statistics); ``m`` (N, C) gives the compute
    dtype and device."""

    def __init__(self, blocks: int, m: torch.Tensor, params, stats: bool):
        c = m.shape[1]
        self.blocks, self.done = blocks, blocks == 1
        live = [p for p in params if p is not None]
        sizes = [0 if p is None else p.numel() for p in params]
        self.size = sum(sizes)  # the parameter gradients' columns, then dmean's and dvar's
        self.width = self.size + (2 * c if stats else 0)
        if blocks == 1:  # final values, written in the parameters' dtypes by the kernel: no cast launch
            self.params = [None if p is None else torch.empty_like(p) for p in params]
            self.stats = (m.new_empty(c), m.new_empty(c)) if stats else (None, None)
            self.stride = 0
            self.part = self.out = None
            slots = list(self.params) + list(self.stats)
        else:  # partials in the compute dtype; the sums in the parameters' dtype (one if they share it)
            dtypes = {p.dtype for p in live}
            self.part = m.new_empty(blocks, self.width)
            self.out = torch.empty(self.size, dtype=dtypes.pop() if len(dtypes) == 1 else m.dtype, device=m.device)
            self.stride = self.width
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.params = [None if p is None else self.out[o:o + p.numel()].view(p.shape)
                           for p, o in zip(params, offsets)]
            slots = [None if p is None else self.part[0, o:o + p.numel()] for p, o in zip(params, offsets)]
            self.stats = tuple(self.part[:, self.size + i * c:self.size + (i + 1) * c] for i in range(2)) \
                if stats else (None, None)
            slots += [None if s is None else s[0] for s in self.stats]
        spare = next((s for s in slots if s is not None), m)
        self.slots = [spare if s is None else s for s in slots]  # a kernel argument for each (unused if absent)

    def result(self, defer: bool):
        """(dmean, dvar, dparams) for the VJP's caller: final values (summed here in torch unless SB = 1), or with
        ``defer`` the (SB, C) partials of dmean, dvar and this object in place of dparams, for dx to finish."""
        if defer and not self.done:
            return self.stats[0], self.stats[1], self
        dmean, dvar = self.finish()
        return dmean, dvar, tuple(self.params)

    def finish(self):
        """Sum the partials in torch (no dx to do it); (dmean, dvar), summed."""
        if not self.done:
            self.out.copy_(self.part[:, :self.size].sum(0))
            self.stats = tuple(None if s is None else s.sum(0) for s in self.stats)
            self.done = True
        return self.stats

    def dx_args(self, programs: int):
        """(part, out, columns, SB, row stride) of :func:`finish` for a dx launch of ``programs`` programs, which
        then holds the sums (columns 0: nothing left to sum). Programs too few to take FINISH_BLOCK columns
        each: torch sums them here first."""
        if not self.done and self.size > programs * FINISH_BLOCK.value:
            self.finish()
        if self.done:
            return self.slots[0], self.slots[0], 0, 1, 0
        self.done = True  # summed by the dx launch these arguments go to
        return self.part, self.out, self.size, self.blocks, self.stride


@triton.jit
def finish(src_ptr, dst_ptr, P, SB, STRIDE, pid, BLOCK: tl.constexpr):
    """dst[j] = sum over b < SB of src[b * STRIDE + j], in block order, for the BLOCK columns j < P of program
    pid: the second stage, in dx's launch (whose programs cover P: ``BlockSums.dx_args``)."""
    j = pid * BLOCK + tl.arange(0, BLOCK)
    mask = j < P
    tl.store(dst_ptr + j, split_sum(src_ptr, j, mask, SB, STRIDE, src_ptr.dtype.element_ty), mask=mask)
