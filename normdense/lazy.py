"""Registry entries whose module is imported on first use, so that ``import normdense`` stays light.

mmengine builds a registry entry by calling it (``build_from_cfg`` accepts functions), so a stand-in
function can import the real class on the first build, register it in its own place (later builds and
``registry.get`` see the class) and return the instance. Used where the import is heavy or optional:
the hooks and ``PretrainedBackbone`` (mmengine.hooks / mmengine.model pull in torch.distributed, ~1.5 s)
and ``PNResNet`` (mmseg's or mmdet's ResNet: seconds, and mmcv's compiled ops). Norm and conv layers stay
eager: mmcv's ``build_norm_layer`` reads attributes of the registered class itself.
"""
from typing import Callable, Optional

from .codebases import require


def lazy_register(registry, name: str, module: str, attr: Optional[str] = None,
                  check: Optional[Callable[[], None]] = None):
    """Register a stand-in for ``module.attr`` under ``name``; ``check()`` runs before the import (it
    raises a one-line error when something the class needs is missing). Returns the stand-in."""
    attr = attr or name

    def build(*args, **kwargs):
        if check is not None:
            check()
        cls = getattr(require(module, name), attr)  # require: one-line error for mmcv's missing ops
        registry.register_module(name=name, module=cls, force=True)
        return cls(*args, **kwargs)

    build.__name__ = build.__qualname__ = name
    build.lazy_target = f'{module}.{attr}'
    registry.register_module(name=name, module=build)
    return build
