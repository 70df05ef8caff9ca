"""Records normalization diagnostics of chosen layers during training (registered as
'NormDiagnosticsHook').

Every ``interval`` training iterations the hook attaches forward hooks to the chosen layers for that one
iteration only (no cost on the other iterations), reduces what they see
(``normdense.analysis.recorder.LayerRecorder``) and writes one scalar per layer and diagnostic:

* ``runner.message_hub.update_scalar('norm_diag/<layer>/<diagnostic>', value)``
* ``runner.visualizer.add_scalars({...}, step=iteration)`` (every configured vis backend)
* one ``runner.logger.info`` line per measurement with the per-diagnostic means over layers.

``ics_moment`` and ``em_distance`` compare the layer's outputs at this measurement with those of the
previous one (``interval`` iterations earlier, Unitization paper Eq. 2-3, 6-7); the two batches differ,
so the value includes sampling noise. They are first reported at the second measurement.

Config::

    custom_hooks = [dict(type='NormDiagnosticsHook', interval=50,
                         layer_types=['Unitization2d', 'BatchChannelNorm2d'], layer_names=['backbone.*'],
                         diagnostics=['statdiff', 'power', 'em_distance'])]
"""
from typing import Optional, Sequence

import torch
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from ..analysis.recorder import (LayerRecorder, check_diagnostics, check_em_method, check_ics_orders, check_snd_cfg,
                                 select_modules)


class NormDiagnosticsHook(Hook):
    """Args:
        interval: measure every ``interval`` training iterations.
        layer_names: fnmatch patterns on module names (``'backbone.layer1.*.un*'``).
        layer_types: class names (a base-class name matches subclasses too, e.g. ``'_BatchNorm'``).
            Given both, a layer must match both; at least one is required.
        diagnostics: any of ``'statdiff'``, ``'snd'``, ``'power'``, ``'ics_moment'``, ``'em_distance'``.
        max_samples: positions kept per layer and measurement for SND / ICS / EM.
        statdiff_groups: channel groups of StatDiff (default: the layer's ``num_groups`` or 1).
        snd_cfg: ``dict(batch_size=2, num_points=16, num_draws=8)`` overrides.
        ics_orders: orders n of the Eq. 6-7 bound.
        em_method: ``'marginal'`` or ``'sliced'`` (see ``normdense.analysis.ics``).
        prefix: key prefix in the message hub / visualizer.
        seed: seed of the sampling generator (reproducible subsets).
    """
    priority = 'LOW'

    def __init__(self, interval: int = 50, layer_names: Optional[Sequence[str]] = None,
                 layer_types: Optional[Sequence[str]] = None,
                 diagnostics: Sequence[str] = ('statdiff', 'power'), max_samples: int = 2048,
                 statdiff_groups: Optional[int] = None, snd_cfg: Optional[dict] = None,
                 ics_orders: Sequence[int] = (2, 3, 4), em_method: str = 'marginal',
                 prefix: str = 'norm_diag', seed: int = 0):
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f'NormDiagnosticsHook interval must be a positive int, got {interval!r}')
        if not layer_names and not layer_types:
            raise ValueError('NormDiagnosticsHook needs layer_names (fnmatch patterns) and/or layer_types '
                             '(class names) to choose the layers to measure')
        self.diagnostics = check_diagnostics(diagnostics)
        self.snd_cfg = check_snd_cfg(snd_cfg)
        if not isinstance(max_samples, int) or max_samples < 2:
            raise ValueError(f'NormDiagnosticsHook max_samples must be an int >= 2, got {max_samples!r}')
        ics_orders = check_ics_orders(ics_orders)
        check_em_method(em_method)
        if statdiff_groups is not None and (not isinstance(statdiff_groups, int) or statdiff_groups < 1):
            raise ValueError(f'statdiff_groups must be a positive int or None, got {statdiff_groups!r}')
        self.interval = interval
        self.layer_names = [layer_names] if isinstance(layer_names, str) else list(layer_names or [])
        self.layer_types = [layer_types] if isinstance(layer_types, str) else list(layer_types or [])
        self.max_samples = max_samples
        self.statdiff_groups = statdiff_groups
        self.ics_orders = tuple(ics_orders)
        self.em_method = em_method
        self.prefix = prefix
        self.seed = seed
        self._recorders = []
        self._reference = {}
        self._active = False

    def before_train(self, runner) -> None:
        model = runner.model.module if is_model_wrapper(runner.model) else runner.model
        layers = select_modules(model, self.layer_names, self.layer_types)
        if not layers:
            raise ValueError(f'NormDiagnosticsHook: no layer matches layer_names={self.layer_names} and '
                             f'layer_types={self.layer_types}')
        gen = torch.Generator().manual_seed(self.seed)
        self._recorders = [LayerRecorder(n, m, self.diagnostics, self.max_samples, self.statdiff_groups, gen)
                           for n, m in layers]
        runner.logger.info(f'NormDiagnosticsHook: {list(self.diagnostics)} every {self.interval} iterations '
                           f'for {len(layers)} layers')

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.every_n_train_iters(runner, self.interval):
            for r in self._recorders:
                r.reset()
                r.attach()
            self._active = True

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if not self._active:
            return
        self._active = False
        for r in self._recorders:
            r.detach()
        step = runner.iter + 1
        scalars = {}
        for r in self._recorders:
            values = r.compute(self._reference.get(r.name), self.snd_cfg, self.ics_orders, self.em_method)
            samples = r.output_samples() if any(d in self.diagnostics for d in ('ics_moment', 'em_distance')) \
                else None
            if samples is not None:
                self._reference[r.name] = samples
            for k, v in values.items():
                scalars[f'{self.prefix}/{r.name}/{k}'] = v
            r.reset()  # drop the captured data until the next measurement
        if not scalars:
            return
        for k, v in scalars.items():
            runner.message_hub.update_scalar(k, v)
        runner.visualizer.add_scalars(scalars, step=step)
        runner.logger.info(f'{self.prefix} (iter {step}): ' + _summary(scalars, self.prefix))

    def after_train(self, runner) -> None:
        for r in self._recorders:
            r.detach()


def _summary(scalars: dict, prefix: str) -> str:
    """Mean over layers of each diagnostic, for the log line. NaN values (e.g. power shares of a layer
    whose output is identically 0, like a zero-initialised residual norm) are left out of the mean."""
    by_metric = {}
    for key, v in scalars.items():
        by_metric.setdefault(key.rsplit('/', 1)[-1], []).append(v)
    parts = []
    for k, vals in sorted(by_metric.items()):
        finite = [v for v in vals if v == v]
        parts.append(f'{k}={sum(finite) / len(finite):.4g}' if finite else f'{k}=nan')
    return ', '.join(parts)
