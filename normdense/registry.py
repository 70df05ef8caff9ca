"""The one place where normdense registers into mmengine's root registries.

mmcv has no registry of its own: its bricks (``build_norm_layer``, ``build_conv_layer``) and mmdet's,
mmseg's and mmpretrain's child registries all resolve through mmengine's root ``MODELS``, so one
registration here makes a layer selectable from any of their configs. Names already taken there
(mmcv's ``ConvWS``, ``GN``, ...) raise ``KeyError``, so ours are new.

Hooks, ``PretrainedBackbone`` and ``PNResNet`` register as stand-ins that import their module on first
build (:mod:`normdense.lazy`): ``import normdense`` imports neither mmengine's hooks/model packages nor any
codebase. ``normdense.registry.<Name>`` still gives the class (imported on access).
"""
import importlib

from mmengine.registry import HOOKS, MODELS, WEIGHT_INITIALIZERS  # noqa: F401

from .codebases import MissingCodebase, is_installed
from .lazy import lazy_register

_LAZY = {}  # attribute of this module -> (module, class name), for __getattr__


def _lazy(registry, name, module, attr=None, check=None):
    _LAZY[name] = (module, attr or name)
    lazy_register(registry, name, module, attr, check)


def __getattr__(name):
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


_lazy(WEIGHT_INITIALIZERS, 'PretrainedBackbone', 'normdense.convert.pretrained_init')
_lazy(HOOKS, 'StrictLoadHook', 'normdense.hooks.strict_load')

# --- the layers: each declares its MODELS name in its own file (layers/declare.py) ------------------
from .layers import declarations  # noqa: E402

for _decl in declarations():
    MODELS.register_module(name=_decl.name, module=_decl.cls)

_lazy(HOOKS, 'EstimateRateHook', 'normdense.hooks.estimate_rate')  # BCN's and Unitization's estimate mode
_lazy(HOOKS, 'BCNRateHook', 'normdense.hooks.estimate_rate')  # the first name, kept for configs
_lazy(HOOKS, 'NormDiagnosticsHook', 'normdense.hooks.diagnostics')


def _needs_resnet_codebase():
    if not (is_installed('mmseg') or is_installed('mmdet')):
        raise MissingCodebase("PNResNet subclasses mmseg's or mmdet's ResNet and neither is installed: "
                              "pip install 'normdense[seg]' or 'normdense[det]'")


# PNResNet subclasses mmseg's ResNet (mmdet's without mmseg), imported on the first build
_lazy(MODELS, 'PNResNet', 'normdense.models.backbones.pn_resnet', check=_needs_resnet_codebase)
_lazy(MODELS, 'PNResNetV1c', 'normdense.models.backbones.pn_resnet', check=_needs_resnet_codebase)
_lazy(HOOKS, 'ProxyNormCheckHook', 'normdense.hooks.proxy_norm_check')
from . import optim  # noqa: F401,E402  (mmengine's norm_decay_mult / bias_decay_mult reach every normdense norm)

# --- The norm switch (normdense/norm_switch.py): runner_type='NormSwitchRunner', model type 'NormSwitched' ---
from mmengine.registry import RUNNERS  # noqa: E402

from .norm_switch import build_norm_switched  # noqa: E402  (light: its imports happen at build time)


class _NormSwitchRunnerStandIn:
    """mmengine's RUNNERS build calls ``cls.from_cfg(cfg)``: import normdense.runner (mmengine.runner, ~1 s)
    only then, as the hooks' stand-ins do."""

    @staticmethod
    def from_cfg(cfg):
        from .runner import NormSwitchRunner
        RUNNERS.register_module(name='NormSwitchRunner', module=NormSwitchRunner, force=True)
        return NormSwitchRunner.from_cfg(cfg)


_LAZY['NormSwitchRunner'] = ('normdense.runner', 'NormSwitchRunner')
RUNNERS.register_module(name='NormSwitchRunner', module=_NormSwitchRunnerStandIn)
MODELS.register_module(name='NormSwitched', module=build_norm_switched)  # the model-type form
