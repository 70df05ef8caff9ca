"""Delivers Algorithm 1's update rate r (= the learning rate) to estimate-mode layers."""
from mmengine.hooks import Hook

from ..layers._estimate import EstimateRateMixin, check_rate, mark_iteration


class EstimateRateHook(Hook):
    """Before every training iteration, set r of each estimate-mode layer (every
    :class:`~normdense.layers._estimate.EstimateRateMixin` without a fixed ``update_rate``: BCN and Unitization in
    ``mode='estimate'``) to ``rate_scale`` x the current learning rate of the optimizer param group that
    holds the layer's parameters (the first group for a layer without parameters).

    ``before_train_iter`` runs before the optimizer step and param schedulers step after the iteration,
    so r is exactly the learning rate this iteration's update uses (warm-up included). r must lie in
    [0, 1]: a rate_scale x lr above 1 stops training with a ``ValueError`` at the iteration it first
    occurs, before any estimate moves (the estimates would overshoot into NaN). Layers with a fixed
    ``update_rate`` are left alone. Registered as ``EstimateRateHook`` and, for older configs, ``BCNRateHook``.

    Args:
        rate_scale: multiply the learning rate by this factor (1.0 = the paper's r = lr).
    """
    priority = 'HIGH'

    def __init__(self, rate_scale: float = 1.0):
        if isinstance(rate_scale, bool) or not isinstance(rate_scale, (int, float)) or not rate_scale >= 0:
            raise ValueError(f'EstimateRateHook rate_scale must be a number >= 0, got {rate_scale!r}')
        self.rate_scale = float(rate_scale)
        self._targets = []

    def before_train(self, runner):
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        optimizer = getattr(runner.optim_wrapper, 'optimizer', None)
        if optimizer is None:
            raise TypeError('EstimateRateHook needs a single optimizer (OptimWrapper), '
                            f'got {type(runner.optim_wrapper).__name__}')
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g['params']}
        self._targets = []
        for m in model.modules():
            if isinstance(m, EstimateRateMixin) and m.needs_update_rate:
                params = list(m.parameters(recurse=False))
                self._targets.append((m, group_of.get(id(params[0]), 0) if params else 0))
        if not self._targets:
            runner.logger.warning('EstimateRateHook: the model has no estimate-mode layer taking its rate '
                                  'from the learning rate; the hook does nothing')
        else:
            runner.logger.info(f'EstimateRateHook: r = {self.rate_scale} x lr for {len(self._targets)} layers')

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        mark_iteration()  # estimate-mode layers move once per iteration, fixed-rate ones included
        groups = runner.optim_wrapper.optimizer.param_groups
        rates = {}
        for module, group in self._targets:
            if group not in rates:  # checked once per param group and iteration
                lr = float(groups[group]['lr'])
                rates[group] = check_rate(
                    self.rate_scale * lr, f'EstimateRateHook: r = rate_scale x lr = {self.rate_scale} x {lr:g} '
                    f'(param group {group}, iteration {runner.iter})')
            module.current_rate = rates[group]


BCNRateHook = EstimateRateHook  # the name configs used first; registered as an alias
