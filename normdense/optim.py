"""mmengine's weight-decay options reach every normdense norm.

mmengine's ``DefaultOptimWrapperConstructor.add_params`` (the constructor every config uses unless it
names another) applies ``norm_decay_mult`` to every parameter of a norm (for its bias in place of
``bias_decay_mult``) and keeps ``bias_lr_mult`` off a norm's bias, where ``isinstance(module,
(_BatchNorm, _InstanceNorm, GroupNorm, LayerNorm))``, names looked up in its module's globals. BCN and
GN+PN subclass ``nn.GroupNorm`` and are covered; the other layers with affine parameters are plain
``nn.Module`` s (``NORM_CLASSES``), so a config with ``norm_decay_mult=0`` would still decay their gamma,
beta (and Unitization's alpha).

Importing this module (``normdense/registry.py`` does) replaces, as soon as mmengine's constructor module
is imported, that module's ``_InstanceNorm`` by the nested tuple ``(_InstanceNorm, *NORM_CLASSES)``, which
``isinstance`` accepts: those classes then get exactly GroupNorm's treatment, and nothing else changes. They do not subclass ``_BatchNorm`` instead,
because mmdet's ``norm_eval`` and ``convert_sync_batchnorm`` would then treat them as BatchNorm. Where an
mmengine version no longer reads that name, a one-line warning says so (and tests/test_weight_decay.py
fails). Codebase constructors with their own ``add_params`` (layer-wise lr decay) are not covered.
"""
import warnings

from .layers import declarations
from .lazy import patch_on_import

__all__ = ['NORM_CLASSES', 'recognise_norms']

# every normdense layer with affine parameters that is not already a GroupNorm / _BatchNorm subclass, as the layers
# declare (BatchChannelNorm2d and GroupProxyNorm subclass nn.GroupNorm; WSConv2d and EquiConv2d are convs)
NORM_CLASSES = tuple(d.cls for d in declarations() if d.decays_as_norm)


def _flatten(classes):
    if isinstance(classes, tuple):
        return tuple(c for item in classes for c in _flatten(item))
    return (classes, )


def recognise_norms(module=None) -> bool:
    """Make ``module.DefaultOptimWrapperConstructor`` (default: mmengine's) count ``NORM_CLASSES`` as norms;
    idempotent. Returns False (after a one-line warning) where that module no longer checks norms this way."""
    if module is None:
        from mmengine.optim.optimizer import default_constructor as module
    constructor = getattr(module, 'DefaultOptimWrapperConstructor', None)
    current = getattr(module, '_InstanceNorm', None)
    reads_name = constructor is not None and '_InstanceNorm' in constructor.add_params.__code__.co_names
    if not reads_name or not all(isinstance(c, type) for c in _flatten(current)):
        warnings.warn(f"normdense: {module.__name__}.DefaultOptimWrapperConstructor no longer checks norms via "
                      f"'_InstanceNorm'; norm_decay_mult / bias_decay_mult do not reach "
                      f"{', '.join(c.__name__ for c in NORM_CLASSES)} (use paramwise_cfg custom_keys)", stacklevel=2)
        return False
    missing = tuple(c for c in NORM_CLASSES if c not in _flatten(current))
    if missing:
        module._InstanceNorm = (current, *missing)
    return True


# applied when mmengine's optimizer constructors are imported (not at `import normdense`: ~1 s)
patch_on_import('mmengine.optim.optimizer.default_constructor', recognise_norms)
