"""Collecting a layer's diagnostics through temporary forward hooks (shared by ``NormDiagnosticsHook``
and ``tools/analyze_norms.py``).

A ``LayerRecorder`` attaches one forward hook to its module only while measuring. Each call reduces the
tensors right away (channel sums for StatDiff, per-image moments for the power decomposition, a random
subset of positions for the sample-based measures) so memory stays bounded however large the maps are.
``compute`` turns the accumulated data into scalars:

* ``statdiff``    mean over groups of StatDiff (WS/BCN Eq. 35) of the layer's input (its output for conv
                  layers: the paper measures "after convolutional layers"); groups = the module's
                  ``num_groups`` when it has one (GN, BCN), else all channels form one group.
* ``snd``         SND (IterNorm Eq. 10) of the layer's training-mode function on batches of B per-position
                  input channel vectors (``analysis.snd.module_snd``; B = ``snd_cfg['batch_size']``).
* ``power``       the power decomposition (PN Eq. 5) of the layer's output over the images seen: each
                  term's share of the power and the channel imbalance.
* ``ics_moment``  the lower bound of Eq. 6-7 (Unitization paper) between the output samples and a
                  reference set (the previous measurement, or another checkpoint), for each order n.
* ``em_distance`` the closed-form EM-distance estimate (``analysis.ics.em_distance``) against the same
                  reference.
"""
import fnmatch
import warnings
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .ics import em_distance, feature_samples, ics_moment_bound
from .power import POWER_TERMS, instance_moments, power_decomposition_from_moments, power_summary
from .snd import module_snd
from .statdiff import statdiff_from_moments

DIAGNOSTICS = ('statdiff', 'snd', 'power', 'ics_moment', 'em_distance')
REFERENCE_DIAGNOSTICS = ('ics_moment', 'em_distance')
DEFAULT_SND_CFG = dict(batch_size=2, num_points=16, num_draws=8)


def check_diagnostics(diagnostics: Iterable[str]) -> Tuple[str, ...]:
    if isinstance(diagnostics, str):
        diagnostics = (diagnostics,)
    diagnostics = tuple(diagnostics)
    unknown = [d for d in diagnostics if d not in DIAGNOSTICS]
    if unknown:
        raise ValueError(f'unknown diagnostic(s) {unknown}; choose from {list(DIAGNOSTICS)}')
    if not diagnostics:
        raise ValueError(f'no diagnostics chosen; choose from {list(DIAGNOSTICS)}')
    return diagnostics


def check_snd_cfg(snd_cfg: Optional[dict]) -> dict:
    cfg = dict(DEFAULT_SND_CFG)
    for k, v in (snd_cfg or {}).items():
        if k not in cfg:
            raise ValueError(f'unknown SND option {k!r}; options are {list(cfg)}')
        cfg[k] = v
    if not all(isinstance(v, int) for v in cfg.values()) or cfg['batch_size'] < 1 or cfg['num_points'] < 1 \
            or cfg['num_draws'] < 2:
        raise ValueError(f'SND options need batch_size >= 1, num_points >= 1, num_draws >= 2 (ints), got {cfg}')
    return cfg


def check_ics_orders(orders: Sequence[int]) -> Tuple[int, ...]:
    orders = tuple(orders)
    if not orders or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in orders):
        raise ValueError(f'ics_orders must be integers >= 2 (Eq. 7), got {orders!r}')
    return orders


def check_em_method(method: str) -> str:
    if method not in ('marginal', 'sliced'):
        raise ValueError(f"em_method must be 'marginal' or 'sliced', got {method!r}")
    return method


def _class_names(module: nn.Module) -> List[str]:
    return [c.__name__ for c in type(module).__mro__]


def select_modules(model: nn.Module, names: Optional[Sequence[str]] = None,
                   types: Optional[Sequence[str]] = None) -> List[Tuple[str, nn.Module]]:
    """Modules of ``model`` whose dotted name matches one of the fnmatch ``names`` patterns (if given)
    and whose class - or a base class - is named in ``types`` (if given). One of the two is required."""
    if not names and not types:
        raise ValueError('select layers by name patterns (layer_names) and/or class names (layer_types)')
    names = [names] if isinstance(names, str) else list(names or [])
    types = [types] if isinstance(types, str) else list(types or [])
    out = []
    for name, m in model.named_modules():
        if not name:
            continue
        if types and not set(types) & set(_class_names(m)):
            continue
        if names and not any(fnmatch.fnmatchcase(name, p) for p in names):
            continue
        out.append((name, m))
    return out


class LayerRecorder:
    """Accumulates what the chosen diagnostics need from one module's forward calls."""

    def __init__(self, name: str, module: nn.Module, diagnostics: Sequence[str], max_samples: int = 2048,
                 statdiff_groups: Optional[int] = None, generator: Optional[torch.Generator] = None):
        self.name = name
        self.module = module
        self.diagnostics = check_diagnostics(diagnostics)
        if not isinstance(max_samples, int) or max_samples < 2:
            raise ValueError(f'max_samples must be an int >= 2, got {max_samples!r}')
        self.max_samples = max_samples
        self.statdiff_groups = statdiff_groups
        self.generator = generator
        self._handle = None
        self.reset()

    # --- hooking ---
    def attach(self) -> None:
        if self._handle is None:
            self._handle = self.module.register_forward_hook(self._on_forward)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def reset(self) -> None:
        self._sums = None          # per-channel [sum, sum of squares, count] for StatDiff
        self._inst_mean, self._inst_std = [], []
        self._in_samples, self._out_samples = [], []
        self._pooled_out = None
        self.calls = 0

    def _subsample(self, x: torch.Tensor) -> torch.Tensor:
        return feature_samples(x, self.max_samples, self.generator).float().cpu()

    def _on_forward(self, module, inputs, output):
        x = inputs[0] if isinstance(inputs, (tuple, list)) and inputs else inputs
        y = output[0] if isinstance(output, (tuple, list)) else output
        if not (torch.is_tensor(x) and torch.is_tensor(y)) or x.dim() < 2 or y.dim() < 2:
            return
        x, y = x.detach(), y.detach()
        self.calls += 1
        if 'statdiff' in self.diagnostics:
            src = y if isinstance(module, nn.modules.conv._ConvNd) else x
            dims = [d for d in range(src.dim()) if d != 1]
            s = src.double()
            sums = torch.stack([s.sum(dims), (s * s).sum(dims),
                                torch.full((s.shape[1],), s.numel() / s.shape[1], dtype=torch.float64,
                                           device=s.device)]).cpu()
            self._sums = sums if self._sums is None else self._sums + sums
        if 'power' in self.diagnostics:
            m, sd = instance_moments(y)
            self._inst_mean.append(m.cpu())
            self._inst_std.append(sd.cpu())
        if 'snd' in self.diagnostics:
            self._in_samples.append(self._subsample(x))
        if any(d in self.diagnostics for d in REFERENCE_DIAGNOSTICS):
            self._out_samples.append(self._subsample(y))

    # --- results ---
    def _pool(self, chunks: List[torch.Tensor]) -> Optional[torch.Tensor]:
        if not chunks:
            return None
        s = torch.cat(chunks)
        if s.shape[0] > self.max_samples:
            s = s[torch.randperm(s.shape[0], generator=self.generator)[:self.max_samples]]
        return s

    def output_samples(self) -> Optional[torch.Tensor]:
        """The pooled output samples (reference for the next measurement's ICS/EM)."""
        if self._pooled_out is None:
            self._pooled_out = self._pool(self._out_samples)
        return self._pooled_out

    def compute(self, reference: Optional[torch.Tensor] = None, snd_cfg: Optional[dict] = None,
                ics_orders: Sequence[int] = (2, 3, 4), em_method: str = 'marginal') -> Dict[str, float]:
        """Scalars for this layer. ICS/EM need ``reference`` output samples; without them they are omitted."""
        out: Dict[str, float] = {}
        if self.calls == 0:
            return out
        if 'statdiff' in self.diagnostics and self._sums is not None:
            total, sq, count = self._sums
            mean = total / count
            std = (sq / count - mean ** 2).clamp(min=0).sqrt()
            groups = self.statdiff_groups or getattr(self.module, 'num_groups', None)
            if not isinstance(groups, int) or groups <= 0 or mean.numel() % groups:
                groups = 1
            out['statdiff'] = statdiff_from_moments(mean, std, groups).mean().item()
        if 'power' in self.diagnostics and self._inst_mean:
            summary = power_summary(power_decomposition_from_moments(torch.cat(self._inst_mean),
                                                                     torch.cat(self._inst_std)))
            for k in POWER_TERMS:
                out[f'power_{k}_frac'] = summary[f'{k}_frac']
            out['power'] = summary['power']
            out['power_channel_imbalance'] = summary['channel_imbalance']
        if 'snd' in self.diagnostics and self._in_samples:
            cfg = check_snd_cfg(snd_cfg)
            pool = self._pool(self._in_samples)
            b = min(cfg['batch_size'], pool.shape[0])
            try:
                out['snd'] = module_snd(self.module, pool, b, cfg['num_points'], cfg['num_draws'], self.generator)
            except Exception as e:  # a layer that cannot run on (B, C, 1, 1) probes
                warnings.warn(f'SND skipped for {self.name}: {type(e).__name__}: {e}')
        samples = self.output_samples() if any(d in self.diagnostics for d in REFERENCE_DIAGNOSTICS) else None
        if samples is not None and reference is not None and reference.shape[1] == samples.shape[1]:
            if 'ics_moment' in self.diagnostics:
                for n in ics_orders:
                    out[f'ics_moment_n{n}'] = ics_moment_bound(samples, reference, n=n)
            if 'em_distance' in self.diagnostics:
                out['em_distance'] = em_distance(samples, reference, method=em_method, generator=self.generator)
        return out
