"""Equilibrium Normalization (EquiNorm; "Controlling Covariate Shift using Equilibrium Normalization of
Weights", ICLR 2019 submission; arXiv:1812.04549 as "...Balanced Normalization..."; Sec. 4.1, Sec. 5.2).

A conv's *weights* are normalized with batch statistics of its *input*. With v_c the sum of the input over
batch and positions of channel c, wbar_dc = sum_jk w_dcjk and r = batch * H_out * W_out * stride^2 (Sec. 4.1)::

    b_d   = - sum_c v_c wbar_dc / (kh * kw * sum_c v_c)        output mean zero (first constraint)
    s_d   = r / sum_c v_c w'+_dc                                positive contribution = r (second constraint)
    w''   = s_d (w_dcjk + b_d)                                  differentiated through (incl. v)

two-pass:    w'+_dc = sum_jk (w_dcjk + b_d) [w_dcjk + b_d > 0]
single pass: w'+_dc ~ w+_dc + b_d n+_dc, w+_dc = sum_jk w_dcjk [w_dcjk > 0], n+_dc = #{w_dcjk > 0} (default)

The layer keeps the input *mean* m_c (b and s are invariant to scaling v with r); sums over c run within a
conv group; ``eps`` (ours) guards the denominators. A ``ChannelAffine`` follows the conv (Sec. 4). Assumptions
(non-negative inputs, balanced kernel signs) and choices: docs/unitization_equinorm.md.
"""
import warnings
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.utils import _pair

from ._utils import compiling, in_transform, refuse_unbatched_update
from .declare import declare
from .eval_form import ChannelAffine, EvalForm, plain_conv  # noqa: F401  (ChannelAffine: EquiNorm's affine, Sec. 4)


def balance_weight_signs_(weight: torch.Tensor, generator: Optional[torch.Generator] = None) -> int:
    """In place, resample the signs of each output channel's kernel lacking a positive or a negative entry
    (Sec. 5.2), keeping magnitudes; returns the number of channels changed (0 on the meta device: no values; a
    meta-built layer balances in ``reset_parameters`` after ``to_empty``)."""
    if weight.is_meta:
        return 0
    with torch.no_grad():
        flat = weight.detach().view(weight.shape[0], -1)
        if flat.shape[1] < 2:
            return 0

        def unbalanced():
            return (~((flat > 0).any(1) & (flat < 0).any(1))).nonzero().flatten()

        bad = unbalanced()
        changed = bad.numel()
        for d in bad.tolist():
            row = flat[d]
            zero = row == 0
            if zero.any():
                row[zero] = row.abs().max().clamp(min=1e-3)
        while bad.numel():
            signs = torch.randint(0, 2, (bad.numel(), flat.shape[1]), generator=generator).to(flat) * 2 - 1
            flat[bad] = flat[bad].abs() * signs
            bad = unbalanced()
    return changed


def _safe_denominator(den: torch.Tensor, eps: float) -> torch.Tensor:
    if eps <= 0:
        return den
    sign = torch.where(den >= 0, torch.ones_like(den), -torch.ones_like(den))
    return torch.where(den.abs() < eps, sign * eps, den)


def conv_rho(conv: nn.Conv2d, h_in: int, w_in: int) -> float:
    """rho = r / (B H_in W_in) = H_out W_out stride^2 / (H_in W_in) of ``conv`` on an H_in x W_in input (Sec. 4.1)."""
    if isinstance(conv.padding, str):
        if conv.padding == 'same':
            return float(conv.stride[0] * conv.stride[1])
        pad = (0, 0)
    else:
        pad = conv.padding
    out = [(size + 2 * p - d * (k - 1) - 1) // s + 1
           for size, p, d, k, s in zip((h_in, w_in), pad, conv.dilation, conv.kernel_size, conv.stride)]
    return out[0] * out[1] * conv.stride[0] * conv.stride[1] / float(h_in * w_in)


def rho_is_one(conv: nn.Conv2d) -> bool:
    """True when rho is 1 for every input size (the output keeps the input's size)."""
    if isinstance(conv.padding, str):
        return conv.padding == 'same'
    return all(s == 1 and d * (k - 1) == 2 * p
               for s, p, d, k in zip(conv.stride, conv.padding, conv.dilation, conv.kernel_size))


class RhoScaledConv2d(nn.Conv2d):
    """EquiConv2d's eval form where rho is not always 1: ``rho(H, W) * conv(x, weight) + bias``, ``weight`` the
    eval kernel at rho = 1 (Sec. 4.1)."""

    def forward(self, x):
        return self._conv_forward(x, self.weight * conv_rho(self, x.shape[2], x.shape[3]), self.bias)


def equinorm_weight(weight: torch.Tensor, input_mean: torch.Tensor, rho: float, groups: int = 1,
                    single_pass: bool = True, eps: float = 0.0) -> torch.Tensor:
    """w'' = s (w + b) (Sec. 4.1) of ``weight`` (C_out, C_in / groups, kh, kw) from the input mean m_c (C_in,)
    and ``rho`` = r / (B H_in W_in)."""
    c_out, c_in_g, kh, kw = weight.shape
    m = input_mean.to(weight.dtype).view(groups, c_in_g)
    m = m.repeat_interleave(c_out // groups, dim=0)
    wbar = weight.sum((2, 3))                                            # wbar_dc
    b = -(m * wbar).sum(1) / _safe_denominator(kh * kw * m.sum(1), eps)  # b_d: output mean zero
    if single_pass:
        pos = weight > 0
        w_pos = (weight * pos).sum((2, 3))                               # w+_dc
        n_pos = pos.sum((2, 3)).to(weight.dtype)                         # n+_dc
        contrib = (m * (w_pos + b[:, None] * n_pos)).sum(1)
    else:
        shifted = weight + b.view(-1, 1, 1, 1)
        contrib = (m * F.relu(shifted).sum((2, 3))).sum(1)               # sum_c v_c w'+_dc
    s = rho / _safe_denominator(contrib, eps)
    return s.view(-1, 1, 1, 1) * (weight + b.view(-1, 1, 1, 1))


def _values_readable(t: torch.Tensor) -> bool:
    """Whether the host can read ``t``'s values: not while torch.compile traces, not inside a torch.func transform
    (vmap's batched tensors refuse it), not on the meta device. The sign check then waits for a plain call."""
    return not (compiling() or t.is_meta or in_transform())


@declare('EquiConv2d', state_keys=('running_input_mean', ), state_name='equinorm')
class EquiConv2d(nn.Conv2d):
    """``nn.Conv2d`` (same arguments, so ``ConvModule`` works) whose kernel is equilibrium-normalized per forward.

    Args (keyword-only, beyond ``nn.Conv2d``'s):
        momentum: update factor of the running per-channel input mean used in eval.
        single_pass: the single-pass s (default, as in the paper's experiments) or the exact two-pass one.
        eps: keeps the denominators at least eps away from zero (ours).
        balance_init: resample the signs of one-signed kernels at init and in ``init_weights`` (Sec. 5.2).
        device, dtype: of the parameters and buffers, as for ``nn.Conv2d``.

    ``reset_parameters`` also resets the running input mean (as nn.BatchNorm2d's resets its running statistics).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = 'zeros', device=None, dtype=None, *,
                 momentum: float = 0.1, single_pass: bool = True, eps: float = 1e-8,
                 balance_init: bool = True):
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f'EquiConv2d momentum must lie in [0, 1], got {momentum!r}')
        if eps < 0:
            raise ValueError(f'EquiConv2d eps must be >= 0, got {eps!r}')
        kh, kw = _pair(kernel_size)
        if (in_channels // groups) * kh * kw < 2:
            raise ValueError(
                'EquiConv2d needs at least 2 weights per output channel (one positive and one negative, '
                f'Sec. 3 assumption 4); got in_channels/groups={in_channels // groups}, kernel {kh}x{kw}')
        self.balance_init = balance_init
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode, device=device, dtype=dtype)
        self.momentum = momentum
        self.single_pass = single_pass
        self.eps = eps
        self.register_buffer('running_input_mean', torch.ones(in_channels, device=device, dtype=dtype))
        self.register_buffer('num_batches_tracked', torch.tensor(0, dtype=torch.long, device=device))
        self.reset_running_stats()

    def reset_running_stats(self) -> None:
        self.running_input_mean.fill_(1)
        self.num_batches_tracked.zero_()
        self._input_sign_checked = False

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, 'balance_init', True):
            balance_weight_signs_(self.weight)
        if hasattr(self, 'running_input_mean'):  # nn.Conv2d.__init__ calls this before the buffers exist
            self.reset_running_stats()

    def init_weights(self) -> None:
        """mmengine calls this after the parent's init_cfg re-drew the weights: restore balanced signs."""
        if self.balance_init:
            balance_weight_signs_(self.weight)

    def rho(self, h_in: int, w_in: int) -> float:
        """r / (B H_in W_in) with r = B H_out W_out stride^2 (Sec. 4.1)."""
        return conv_rho(self, h_in, w_in)

    def normalized_weight(self, input_mean: torch.Tensor, h_in: int, w_in: int) -> torch.Tensor:
        return equinorm_weight(self.weight, input_mean, self.rho(h_in, w_in), self.groups, self.single_pass,
                               self.eps)

    def eval_weight(self, rho: float = 1.0) -> torch.Tensor:
        """The eval-mode kernel ``s (w + b)`` from the running input mean at the given rho, float64."""
        return equinorm_weight(self.weight.detach().double(), self.running_input_mean.double(), rho, self.groups,
                               self.single_pass, self.eps)

    def eval_form(self, dtype: torch.dtype = torch.float64) -> EvalForm:
        """The eval conv: ``s (w + b)`` from the running input mean at rho = 1, as an ``nn.Conv2d`` where rho is
        always 1, else a :class:`RhoScaledConv2d` that applies the input's rho per forward."""
        with torch.no_grad():
            weight = self.eval_weight(rho=1.0)
        return EvalForm(None, None, plain_conv(self, weight, nn.Conv2d if rho_is_one(self) else RhoScaledConv2d),
                        self.weight.dtype, self.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f'EquiConv2d expects (N, C, H, W) input, got shape {tuple(x.shape)}')
        if self.training and x.numel() > 0:
            refuse_unbatched_update(self, x, self.running_input_mean)
            mean = x.mean((0, 2, 3))  # m_c = v_c / (B H W), differentiated through
            if not self._input_sign_checked and _values_readable(mean):
                # once only (it syncs): a zero-mean input makes sum_c v_c ~ 0 and b, s explode (Sec. 3, 5.2)
                self._input_sign_checked = True
                if bool((mean.detach() < 0).any()):
                    warnings.warn('EquiConv2d got input channels with negative mean; EquiNorm assumes '
                                  'non-negative (post-ReLU) inputs and is ill-conditioned otherwise '
                                  '(see docs/unitization_equinorm.md)')
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                self.running_input_mean.lerp_(mean.detach().to(self.running_input_mean.dtype), self.momentum)
        else:
            mean = self.running_input_mean
        w = self.normalized_weight(mean, x.shape[2], x.shape[3]).to(x.dtype)
        return self._conv_forward(x, w, self.bias)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f', momentum={self.momentum}, single_pass={self.single_pass}, '
                f'eps={self.eps}')
