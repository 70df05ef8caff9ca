"""Every normdense layer and mode as a small test case, shared by the device tests in this folder.

Each case builds the layer on the CPU in float32 (``case.build()``); ``case.input(device, dtype)`` is a
fixed random input of the shape it expects (non-negative for EquiConv2d, whose formulas assume post-ReLU
inputs). Estimate modes get a fixed ``update_rate`` so that they train without ``BCNRateHook``.
"""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn as nn

from normdense.layers.bcn import BatchChannelNorm2d
from normdense.layers.equinorm import ChannelAffine, EquiConv2d
from normdense.layers.iternorm import IterNorm
from normdense.layers.proxy_norm import GroupProxyNorm
from normdense.layers.unitization import Unitization2d
from normdense.layers.ws import WSConv2d

C = 32  # channels of every case (IterNorm: groups of 12, 12 and a smaller last one of 8)
SHAPE = (2, C, 6, 5)


@dataclass
class Case:
    name: str
    factory: Callable[[], nn.Module]
    non_negative: bool = False  # input after a ReLU (EquiNorm's assumption)
    # ops whose CUDA kernels synchronize with the host by design (documented in the layer)
    known_syncs: tuple = ()

    def build(self) -> nn.Module:
        torch.manual_seed(0)
        return self.factory()

    def input(self, device='cpu', dtype=torch.float32, seed=1, shape=SHAPE) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(shape, generator=g, dtype=torch.float64) + 0.5
        x = x.relu() if self.non_negative else x
        return x.to(device=device, dtype=dtype)


CASES = [
    Case('WSConv2d paper', lambda: WSConv2d(C, C, 3, padding=1)),
    Case('WSConv2d std_unbiased', lambda: WSConv2d(C, C, 3, padding=1, formula='std_unbiased')),
    Case('WSConv2d var_unbiased', lambda: WSConv2d(C, C, 3, padding=1, formula='var_unbiased')),
    Case('BCN estimate', lambda: BatchChannelNorm2d(C, 8, mode='estimate', update_rate=0.1)),
    Case('BCN estimate per-channel affine', lambda: BatchChannelNorm2d(C, 8, update_rate=0.1, group_affine=False)),
    Case('BCN estimate reference', lambda: BatchChannelNorm2d(C, 8, update_rate=0.1, fused=False)),
    Case('BCN batch', lambda: BatchChannelNorm2d(C, 8, mode='batch')),
    Case('BCN batch reference', lambda: BatchChannelNorm2d(C, 8, mode='batch', fused=False)),
    Case('GNPN', lambda: GroupProxyNorm(C, 8)),
    Case('GNPN gelu', lambda: GroupProxyNorm(C, 8, act='gelu')),
    Case('GNPN gelu reference', lambda: GroupProxyNorm(C, 8, act='gelu', fused=False)),
    Case('IterNorm', lambda: IterNorm(C, group_size=12, T=5)),
    Case('IterNorm recompute', lambda: IterNorm(C, group_size=12, T=5, recompute=True)),
    # torch.linalg.eigh checks its solver's status on the host: ZCA is for analysis, not training
    Case('IterNorm zca', lambda: IterNorm(C, group_size=12, method='zca'), known_syncs=('linalg_eigh', )),
    Case('Unitization batch', lambda: Unitization2d(C)),
    Case('Unitization batch cumulative', lambda: Unitization2d(C, momentum=None)),
    Case('Unitization batch reference', lambda: Unitization2d(C, fused=False)),
    Case('Unitization keras conventions', lambda: Unitization2d(C, norm_divisor='hw_squared', var_correction='keras')),
    Case('Unitization estimate', lambda: Unitization2d(C, mode='estimate', update_rate=0.1)),
    Case('Unitization estimate reference', lambda: Unitization2d(C, mode='estimate', update_rate=0.1, fused=False)),
    Case('EquiConv2d', lambda: EquiConv2d(C, C, 3, padding=1), non_negative=True),
    Case('EquiConv2d two-pass stride 2', lambda: EquiConv2d(C, C, 3, stride=2, padding=1, single_pass=False),
         non_negative=True),
    Case('ChannelAffine', lambda: ChannelAffine(C)),
]


def case_params(cases=CASES):
    return [pytest.param(c, id=c.name.replace(' ', '-')) for c in cases]


def fuse_model() -> nn.Module:
    """A 16-channel chain with every foldable pair and every standalone norm of ``deploy.fuse`` (input
    (N, 16, H, W), non-negative for the EquiConv2d)."""
    torch.manual_seed(0)
    return nn.Sequential(
        EquiConv2d(16, 16, 3, padding=1, bias=False), ChannelAffine(16), nn.ReLU(),
        WSConv2d(16, 16, 3, padding=1), BatchChannelNorm2d(16, 4, update_rate=0.1), nn.ReLU(),
        nn.Conv2d(16, 16, 1, bias=False), IterNorm(16, group_size=6), nn.ReLU(),
        EquiConv2d(16, 16, 3, stride=2, padding=1), Unitization2d(16), nn.ReLU(),
        WSConv2d(16, 16, 1), BatchChannelNorm2d(16, 4, mode='batch'),
        IterNorm(16, group_size=8), Unitization2d(16), BatchChannelNorm2d(16, 4, update_rate=0.1))
