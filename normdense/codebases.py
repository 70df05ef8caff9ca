"""Which OpenMMLab codebases are installed, and one-line errors naming the extra that installs a missing one.

normdense needs only torch + mmengine + mmcv; mmdet, mmsegmentation and mmpretrain are the extras
``normdense[det]``, ``normdense[seg]`` and ``normdense[pretrain]`` (setup.py). A config of a codebase
that is not installed (its ``default_scope`` or an ``mmseg::...`` base) fails with :class:`MissingCodebase`.
"""
import importlib
import importlib.util
import warnings

from mmengine.config import Config

from .errors import PKG_RESOURCES_FIX, MmcvOpsError, SetupError, UserFixable, mmcv_ops_problem

# import name -> (distribution name, normdense extra)
CODEBASES = {
    'mmdet': ('mmdet', 'det'),
    'mmseg': ('mmsegmentation', 'seg'),
    'mmpretrain': ('mmpretrain', 'pretrain'),
}


class MissingCodebase(UserFixable, ImportError):
    """An OpenMMLab codebase a config or layer needs is not installed (one-line message with the fix)."""


def is_installed(package: str) -> bool:
    """Whether ``package`` can be found (not imported: importing mmdet/mmseg takes seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a blocked/broken finder, or a half-imported module
        return False


def missing_message(package: str, needed_by: str) -> str:
    dist, extra = CODEBASES[package]
    return (f"{needed_by} needs {dist} ({package}), which is not installed: "
            f"pip install 'normdense[{extra}]' (or pip install {dist})")


def require(package: str, needed_by: str):
    """Import and return ``package``; a missing codebase raises :class:`MissingCodebase`, one whose import
    fails on mmcv's ops (mmcv-lite, or built for another torch) :class:`~normdense.errors.MmcvOpsError`."""
    if package.split('.')[0] in CODEBASES and not is_installed(package.split('.')[0]):
        raise MissingCodebase(missing_message(package.split('.')[0], needed_by))
    try:
        return importlib.import_module(package)
    except ImportError as e:
        problem = mmcv_ops_problem(e)
        if problem is None:
            raise
        raise MmcvOpsError(f'{needed_by} imports {package}, but {problem}') from e


def config_path(name: str) -> str:
    """A config file from a path or a packaged name: ``mmdet::retinanet/retinanet_r50_fpn_1x_coco.py``
    (``mmseg::``, ``mmpretrain::``) is resolved by mmengine's own rule for ``_base_`` names (the package's
    ``.mim/configs``). ``FileNotFoundError`` (one line) when there is no such file; a codebase that is not
    installed: :class:`MissingCodebase`."""
    import os.path as osp
    if '::' not in name:
        if not osp.isfile(name):
            raise FileNotFoundError(f'config file not found: {name}')
        return name
    from mmengine.config.utils import _get_external_cfg_base_path, _get_package_and_cfg_path
    from mmengine.utils import get_installed_path
    package = name.split('::', 1)[0]
    if package in CODEBASES and not is_installed(package):
        raise MissingCodebase(missing_message(package, f'config {name}'))
    try:
        package, relative = _get_package_and_cfg_path(name)
        return _get_external_cfg_base_path(get_installed_path(package), relative)
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"config {name}: {e} (names are '<package>::<folder>/<file>.py' under the "
                                "package's .mim/configs, as in a config's _base_)") from None


def read_config(path: str) -> Config:
    """``Config.fromfile`` of a path or a ``mmdet::...`` name (:func:`config_path`), with a one-line
    :class:`MissingCodebase` when a ``mmseg::...``-style base of the config (or of its bases) belongs to a
    codebase that is not installed."""
    path = config_path(path)
    try:
        with warnings.catch_warnings():  # setuptools 67-80 warn on every `import pkg_resources` (mmengine's)
            warnings.filterwarnings('ignore', message='pkg_resources is deprecated', category=UserWarning)
            return Config.fromfile(path)
    except ModuleNotFoundError as e:
        if e.name == 'pkg_resources':
            raise SetupError(f'config {path}: {PKG_RESOURCES_FIX}') from None
        # mmengine: "<distribution> is not installed, please install <distribution> manually"
        words = str(e).split()
        by_dist = {dist: package for package, (dist, _) in CODEBASES.items()}
        package = e.name if e.name in CODEBASES else by_dist.get(words[0] if words else None)
        if package is None:
            raise
        raise MissingCodebase(missing_message(package, f'config {path}')) from None

