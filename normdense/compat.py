"""Import-time check of the core stack against the ranges normdense supports (normdense/version.py).

Like mmdet's ``mmcv_minimum_version <= mmcv < mmcv_maximum_version`` check: an unsupported torch,
mmengine or mmcv stops ``import normdense`` with one line that names the supported range and the fix,
instead of failing later inside a layer or a Runner.
"""
import os
import re
from typing import Dict, Optional, Tuple

from . import version as _v

# ``NORMDENSE_LAYERS_ONLY=1``: ``import normdense`` checks torch alone and registers nothing into mmengine, so
# the layers, the kernels and deploy.fuse import on a machine with torch (and triton) only, e.g. a GPU machine
# without an mmcv build (scripts/gpu_check.sh sets it there)
LAYERS_ONLY_ENV = 'NORMDENSE_LAYERS_ONLY'
LAYERS_ONLY = os.environ.get(LAYERS_ONLY_ENV) == '1'  # as the process started: what `import normdense` did

# name -> (minimum, exclusive maximum or None, how to install a supported one)
SUPPORTED: Dict[str, Tuple[str, Optional[str], str]] = {
    'torch': (_v.torch_minimum_version, None, 'pip install "torch>={lo}"'),
    'mmengine': (_v.mmengine_minimum_version, _v.mmengine_maximum_version, 'pip install "mmengine>={lo},<{hi}"'),
    'mmcv': (_v.mmcv_minimum_version, _v.mmcv_maximum_version,
             'pip install -U openmim && mim install "mmcv>={lo},<{hi}" (prebuilt with ops)'),
}


def parse_version(text: str) -> tuple:
    """``'2.1.2+cu121'`` -> ``(2, 1, 2, 0)``; pre-releases sort before their release:
    ``'2.0.0rc4'`` -> ``(2, 0, 0, -1, 0, 4)``. Enough for the releases of torch, mmengine and mmcv."""
    release = text.split('+')[0]
    match = re.match(r'^(\d+(?:\.\d+)*)(?:\.?(a|b|rc|dev)(\d*))?', release)
    if not match:
        raise ValueError(f'unparseable version {text!r}')
    numbers = [int(n) for n in match.group(1).split('.')]
    numbers += [0] * (3 - len(numbers))
    if match.group(2):
        return (*numbers, -1, {'dev': -3, 'a': -2, 'b': -1, 'rc': 0}[match.group(2)], int(match.group(3) or 0))
    return (*numbers, 0)


def supported_range(name: str) -> str:
    lo, hi, _ = SUPPORTED[name]
    return f'{name}>={lo}' + (f',<{hi}' if hi else '')


def version_problem(name: str, installed: Optional[str]) -> Optional[str]:
    """The one-line complaint about ``installed`` (None: not installed), or None if it is supported."""
    lo, hi, fix = SUPPORTED[name]
    fix = fix.format(lo=lo, hi=hi)
    if installed is None:
        return f'normdense needs {supported_range(name)}, which is not installed: {fix}'
    have = parse_version(installed)
    if have < parse_version(lo) or (hi is not None and have >= parse_version(hi)):
        return f'normdense supports {supported_range(name)}, found {name} {installed}: {fix}'
    return None


def installed_versions(names=None) -> Dict[str, Optional[str]]:
    """``__version__`` of each core package (module attribute, so mmcv-lite counts as mmcv); ``names``: only
    those (default all)."""
    found = {}
    for name in names or SUPPORTED:
        try:
            module = __import__(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise
            found[name] = None
        else:
            found[name] = module.__version__
    return found


def check_core_versions(versions: Optional[Dict[str, Optional[str]]] = None, names=None) -> None:
    """Raise ``ImportError`` (one line per unsupported package) unless every core package (or each of
    ``names``) is in range."""
    names = tuple(names or SUPPORTED)
    versions = installed_versions(names) if versions is None else versions
    problems = [p for p in (version_problem(name, versions.get(name)) for name in names) if p]
    if problems:
        raise ImportError('\n'.join(problems))
