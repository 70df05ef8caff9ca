"""The StatNorm layers' state (BCN, GN+PN, Unitization): their flags and buffers (running statistics, or
Algorithm 1's estimates, and ``num_batches_tracked``), how the buffers load and move, and the dtype policy. The
engine (``_statnorm.py``) builds ``forward`` on it."""
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..kernels.backend import HALF as _HALF
from ..kernels.backend import check_backend, track_
from ._estimate import Estimates


class StatNormState(nn.Module):
    """Flags, buffers and dtype policy of a StatNorm layer.

    Buffers (not GN+PN's): ``running_mean``, ``running_var`` (estimates in estimate mode) and
    ``num_batches_tracked`` (iterations in estimate mode, calls in batch mode; 0 when a version-1 checkpoint
    lacks it, as torch's BatchNorm loads its old versions).

    Dtype policy: statistics in float32 (float64 where x or a parameter is; never fp16/bf16: sums over positions
    overflow or round away); y in x's dtype under autocast too, as nn.BatchNorm2d (nn.GroupNorm writes float32);
    estimates stay float32 under ``model.half()`` (an r-sized update is below bf16's resolution).
    """
    _FIRST_STAGE = True  # per-channel statistics before the map (GN+PN: none)
    _SYNC_BATCH = False  # batch-mode statistics all-reduced with sync_stats (BCN)
    _ESTIMATE_BUFFERS = ('running_mean', 'running_var')  # float32 under .half() in estimate mode
    _version = 2  # 2: num_batches_tracked for every layer with a first stage (BCN's checkpoints of 1 lack it)

    def _init_statnorm(self, num_features: int, mode: Optional[str], sync_stats: bool, fused: bool,
                       backend: Optional[str], momentum=None, device=None, dtype=None) -> None:
        self.mode, self.sync_stats, self.momentum = mode, bool(sync_stats), momentum
        self.fused = bool(fused)
        self.backend = check_backend(backend, f'{type(self).__name__} backend')
        self._estimates = Estimates()
        if self._FIRST_STAGE:  # 'batch': eval statistics; 'estimate': the estimates mu_hat, sigma_hat^2
            if mode == 'estimate' and dtype in _HALF:  # as .half() leaves them (the class docstring)
                dtype = torch.float32
            self.register_buffer('running_mean', torch.zeros(num_features, device=device, dtype=dtype))
            self.register_buffer('running_var', torch.ones(num_features, device=device, dtype=dtype))
            self.register_buffer('num_batches_tracked', torch.tensor(0, dtype=torch.long, device=device))

    def _reset_statnorm_buffers(self) -> None:
        self.running_mean.zero_()
        self.running_var.fill_(1.0)
        self.num_batches_tracked.zero_()

    def _buffers3(self):
        b = self._buffers
        return b['running_mean'], b['running_var'], b.get('num_batches_tracked')

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        self._estimates.reset()  # new estimates: the next call starts a new iteration from them
        key = prefix + 'num_batches_tracked'
        if self._FIRST_STAGE and local_metadata.get('version', 1) < 2 and key not in state_dict:
            state_dict[key] = torch.tensor(0, dtype=torch.long)  # as torch's _NormBase for its version 1
        return super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        if '_estimates' in self.__dict__:  # its tensors stay behind: start anew from the moved buffers
            self._estimates.reset()
        if getattr(self, 'mode', None) != 'estimate':
            return super()._apply(fn, *args, **kwargs)
        before = {n: self._buffers[n] for n in self._ESTIMATE_BUFFERS if self._buffers.get(n) is not None}
        out = super()._apply(fn, *args, **kwargs)
        for n, old in before.items():
            new = self._buffers[n]
            if new.dtype in _HALF:  # from the fp32 values: no rounding on the way
                self._buffers[n] = old.detach().to(device=new.device, dtype=torch.float32)
        return out

    @staticmethod
    def stat_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
        """The compute dtype of statistics over ``tensors``: float64 if any is float64, else float32."""
        for t in tensors:  # a loop, not any(generator)
            if t is not None and t.dtype == torch.float64:
                return torch.float64
        return torch.float32

    @staticmethod
    def compute_input(x: torch.Tensor) -> torch.Tensor:
        """x as the reference compositions compute on it: half inputs in float32, others as they are."""
        return x.float() if x.dtype in _HALF else x

    def _output_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def _statnorm_dtypes(self, x: torch.Tensor) -> Tuple[torch.dtype, torch.dtype]:
        """(compute dtype, output dtype) by the dtype policy."""
        return self.stat_dtype(x, *self._statnorm_params()), self._output_dtype(x)

    def _statnorm_repr(self) -> str:
        return ('' if self.fused else ', fused=False') + (f', backend={self.backend!r}' if self.backend else '')

    def estimates_from_input(self, x: torch.Tensor):
        """This training call's estimates (mean, var) from x (N, C, ...): the reference compositions' first stage."""
        with torch.no_grad():
            xf = self.compute_input(x)
            x3 = xf.reshape(xf.shape[0], xf.shape[1], math.prod(xf.shape[2:]))
            if x3.numel():
                v, m = torch.var_mean(x3, dim=2, correction=0)
            else:  # no values (a RoI head without RoIs): a count of 0 below
                m = v = x3.new_zeros(x3.shape[:2])
            return self._estimates.estimates(m, v, x3.shape[2], self._buffers3(), self._rate, self.sync_stats)

    def _track(self, mean: torch.Tensor, var: torch.Tensor, count) -> None:
        """The running statistics after a batch of ``count`` values per channel (an int, or a tensor after an
        all-reduce), outside the backends (the collective path, the reference compositions)."""
        with torch.no_grad():
            nbt = self._buffers.get('num_batches_tracked')
            track_(self.running_mean, self.running_var, mean, var, count, self.momentum, nbt)
            if nbt is not None:
                nbt.add_(1)
