"""Hook that fails fast when an activation is applied on top of a GNPN layer.

Proxy Normalization's layer (``GNPN``) already contains the activation (Eq. 7 of the PN paper), so
a config that keeps the usual activation after it (mmcv ``ConvModule`` with the default
``act_cfg=dict(type='ReLU')``, mmdet/mmseg ``ResNet`` blocks, ``Sequential(norm, ReLU)``) silently
builds a different model. Where to check:

* Inside ``GNPN`` at build time the layer cannot see which activation its parent adds; checking
  inside ``ConvModule`` would mean patching mmcv. So the check runs on the **built model**.
* ``before_run``: static check of the module tree (ConvModule ``order``/``act_cfg`` and
  ``nn.Sequential`` neighbours), before any training happens.
* First training iteration: module hooks watch which activation modules receive a PN output
  (catches ReLUs called inside ``forward`` code, e.g. using ``ResNet`` instead of ``PNResNet``);
  the hooks are removed after that iteration, so later iterations cost nothing.

Both raise ``ValueError`` naming the offending modules. ``configs/_base_/proxy_norm.py`` adds this
hook; the same checks are available as plain functions in ``normdense.layers.proxy_norm``.
"""
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from ..layers.proxy_norm import ActivationAfterProxyNormGuard, check_proxy_norm_placement


class ProxyNormCheckHook(Hook):
    """Static check before the run, run-time check during the first training iteration.

    Args:
        check_forward: also run :class:`ActivationAfterProxyNormGuard` on the first training
            iteration.
    """
    priority = 'VERY_HIGH'

    def __init__(self, check_forward: bool = True):
        self.check_forward = check_forward
        self._guard = None
        self._forward_checked = False

    @staticmethod
    def _model(runner):
        model = runner.model
        return model.module if is_model_wrapper(model) else model

    def before_run(self, runner) -> None:
        check_proxy_norm_placement(self._model(runner))

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.check_forward and not self._forward_checked and self._guard is None:
            self._guard = ActivationAfterProxyNormGuard(self._model(runner)).__enter__()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._guard is not None:
            guard, self._guard = self._guard, None
            self._forward_checked = True
            guard.__exit__(None, None, None)  # raises ValueError if a violation was seen
