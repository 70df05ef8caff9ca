"""Registry entries whose module is imported on first use, so that ``import normdense`` stays light.

mmengine builds a registry entry by calling it (``build_from_cfg`` accepts functions), so a stand-in
function can import the real class on the first build, register it in its own place (later builds and
``registry.get`` see the class) and return the instance. Used where the import is heavy or optional:
the hooks and ``PretrainedBackbone`` (mmengine.hooks / mmengine.model pull in torch.distributed, ~1.5 s)
and ``PNResNet`` (mmseg's or mmdet's ResNet: seconds, and mmcv's compiled ops). Norm and conv layers stay
eager: mmcv's ``build_norm_layer`` reads attributes of the registered class itself.
"""
import sys
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


class _PatchOnImport:
    """A ``sys.meta_path`` finder that runs ``patch(module)`` right after the module ``name`` is executed
    (once): the patch applies whenever the module is used, and ``import normdense`` does not pay for
    importing it (mmengine.runner and mmengine.optim pull in torch.distributed, ~1 s)."""

    def __init__(self, name: str, patch: Callable):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        import importlib.util
        sys.meta_path.remove(self)  # once; the real finders locate the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, 'exec_module'):
            exec_module, patch = spec.loader.exec_module, self.patch

            def exec_and_patch(module):
                exec_module(module)
                patch(module)
            spec.loader.exec_module = exec_and_patch
        return spec


def patch_on_import(name: str, patch: Callable) -> None:
    """``patch(module)`` now if the module ``name`` is imported already, else right after it is."""
    if name in sys.modules:
        patch(sys.modules[name])
    elif not any(isinstance(f, _PatchOnImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport(name, patch))
