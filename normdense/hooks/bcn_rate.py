"""Delivers Algorithm 1's update rate r (= the learning rate) to estimate-mode layers."""
from mmengine.hooks import Hook


class BCNRateHook(Hook):
    """Before every training iteration, set r of each estimate-mode layer (BCN, and any layer exposing
    ``needs_update_rate``) to the current learning rate of the optimizer param group that holds the
    layer's parameters (the first group for a layer without parameters).

    ``before_train_iter`` runs before the optimizer step and param schedulers step after the iteration,
    so r is exactly the learning rate this iteration's update uses (warm-up included).
    Layers with a fixed ``update_rate`` are left alone.

    Args:
        rate_scale: multiply the learning rate by this factor (1.0 = the paper's r = lr).
    """
    priority = 'HIGH'

    def __init__(self, rate_scale: float = 1.0):
        if rate_scale < 0:
            raise ValueError(f'BCNRateHook rate_scale must be >= 0, got {rate_scale}')
        self.rate_scale = rate_scale
        self._targets = []

    def before_train(self, runner):
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        optimizer = getattr(runner.optim_wrapper, 'optimizer', None)
        if optimizer is None:
            raise TypeError('BCNRateHook needs a single optimizer (OptimWrapper), '
                            f'got {type(runner.optim_wrapper).__name__}')
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g['params']}
        self._targets = []
        for name, m in model.named_modules():
            if getattr(m, 'needs_update_rate', False):
                params = list(m.parameters(recurse=False))
                self._targets.append((m, group_of.get(id(params[0]), 0) if params else 0))
        if not self._targets:
            runner.logger.warning('BCNRateHook: the model has no estimate-mode layer taking its rate '
                                  'from the learning rate; the hook does nothing')
        else:
            runner.logger.info(f'BCNRateHook: r = {self.rate_scale} x lr for {len(self._targets)} layers')

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        groups = runner.optim_wrapper.optimizer.param_groups
        for module, group in self._targets:
            module.current_rate = self.rate_scale * float(groups[group]['lr'])
