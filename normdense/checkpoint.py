"""Let mmengine 0.10.7 load its own Runner checkpoints on torch >= 2.6 without turning ``weights_only`` off.

torch >= 2.6 loads with ``weights_only=True`` by default and mmengine 0.10.7 calls ``torch.load`` without
the argument, so ``--resume`` and ``load_from`` fail on the globals a Runner checkpoint pickles besides
tensors (``torch.serialization.get_unsafe_globals_in_checkpoint`` lists them):

* the message hub's ``mmengine.logging.history_buffer.HistoryBuffer`` objects, holding numpy arrays
  (``numpy.ndarray``, ``numpy.dtype``, ``numpy._core.multiarray._reconstruct``) and numpy scalars
  (``numpy._core.multiarray.scalar``); restoring a dtype needs its class (``numpy.dtypes.Float64DType``, ...);
* ``builtins.getattr``: HistoryBuffer pickles its statistics functions as ``getattr(HistoryBuffer,
  'min')``. A general ``getattr`` would let a checkpoint walk from any allowed object to ``eval``, so it
  is *not* allowed: the name is bound to ``_history_buffer_statistic``, which resolves only those
  functions and refuses everything else.

Every other global is still refused, so a checkpoint that pickles an arbitrary class cannot run code.
"""
import pickle
from typing import Optional

import numpy as np
import torch

from .errors import UserFixable
from .norms import CHOICES, STATE_KEYS


def _numpy_multiarray():
    # numpy 2 pickles through numpy._core; numpy 1 through numpy.core
    core = getattr(np, '_core', None) or np.core
    return core.multiarray


def _history_buffer_statistic(obj, name):
    """``getattr`` restricted to ``HistoryBuffer``'s statistics functions (what its pickles ask for)."""
    from mmengine.logging.history_buffer import HistoryBuffer
    if obj is HistoryBuffer and name in {'min', 'max', 'current', 'mean'} | set(HistoryBuffer._statistics_methods):
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(
        f'weights-only load refused getattr({obj!r}, {name!r}): normdense allows getattr only for '
        'mmengine HistoryBuffer statistics')


def mmengine_checkpoint_globals():
    """The (object, pickled name) pairs a Runner checkpoint needs beyond tensors and builtins."""
    from mmengine.logging.history_buffer import HistoryBuffer
    multiarray = _numpy_multiarray()
    path = multiarray.__name__
    return [(HistoryBuffer, 'mmengine.logging.history_buffer.HistoryBuffer'),
            (np.ndarray, 'numpy.ndarray'), (np.dtype, 'numpy.dtype'),
            (multiarray._reconstruct, f'{path}._reconstruct'), (multiarray.scalar, f'{path}.scalar'),
            (_history_buffer_statistic, 'builtins.getattr')] + [(cls, None) for cls in _numpy_dtype_classes()]


def _numpy_dtype_classes():
    """The per-dtype classes of numpy's numeric and bool dtypes (numpy >= 1.25 has them)."""
    kinds = (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
             np.float16, np.float32, np.float64)
    return sorted({type(np.dtype(k)) for k in kinds} - {np.dtype}, key=lambda c: c.__name__)


def allow_mmengine_checkpoint_types():
    """Register the globals with ``torch.serialization.add_safe_globals`` (idempotent)."""
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is None:  # torch < 2.4: no weights-only default to work around
        return
    known = set(map(repr, torch.serialization.get_safe_globals()))
    entries = [obj if name is None else (obj, name) for obj, name in mmengine_checkpoint_globals()]
    add([entry for entry in entries if repr(entry) not in known])


# --------------------------------------------------------------------------------------------------
# Reading checkpoints: one safe torch.load for every scheme mmengine's CheckpointLoader serves
# --------------------------------------------------------------------------------------------------
class CheckpointReadError(RuntimeError):
    """A checkpoint that cannot be read (damaged, empty, not a torch file, download failed)."""


class UnsafeCheckpointError(CheckpointReadError, pickle.UnpicklingError):
    """A checkpoint that pickles globals a weights-only load refuses (possibly malicious)."""


def _first_sentence(text: str) -> str:
    text = ' '.join(str(text).split())
    return text.split('. ')[0].rstrip('.')


def safe_torch_load(file, map_location=None, name=None):
    """``torch.load(file, weights_only=True)`` whose failures are one line:
    ``cannot read checkpoint NAME: <reason>``.

    ``weights_only`` is passed explicitly, so the load is safe on every torch (the default only became
    ``True`` in torch 2.6) and whatever ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says. A pickle that needs a
    global outside the allow-list raises :class:`UnsafeCheckpointError` (a ``pickle.UnpicklingError``);
    a damaged, truncated or empty file raises :class:`CheckpointReadError` instead of torch's hint to
    retry with ``weights_only=False``.
    """
    name = name or str(file)
    if isinstance(file, (str, bytes)) or hasattr(file, '__fspath__'):
        import os
        if os.path.isfile(file) and os.path.getsize(file) == 0:
            raise CheckpointReadError(f'cannot read checkpoint {name}: the file is empty')
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except pickle.UnpicklingError as e:
        inner = e.__context__ if isinstance(e.__context__, Exception) else e
        reason = _first_sentence(inner)
        if 'GLOBAL' in reason or 'global' in reason:
            raise UnsafeCheckpointError(
                f'cannot read checkpoint {name}: refused by the weights-only load ({reason}); normdense never '
                'unpickles arbitrary objects: re-save only its tensors in a trusted environment') from None
        raise CheckpointReadError(f'cannot read checkpoint {name}: not a torch checkpoint or damaged '
                                  f'({reason})') from None
    except Exception as e:  # RuntimeError (bad zip), EOFError, KeyError, ... from a damaged file
        reason = _first_sentence(e) or type(e).__name__
        raise CheckpointReadError(f'cannot read checkpoint {name}: damaged or not a torch checkpoint '
                                  f'({type(e).__name__}: {reason})') from None


def _load_from_local(filename, map_location=None):
    """mmengine's ``load_from_local`` with an explicit weights-only load and one-line errors."""
    import os.path as osp
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'checkpoint not found: {filename}')
    return safe_torch_load(filename, map_location=map_location, name=filename)


def _load_url(url, model_dir=None, map_location=None, progress=True, check_hash=False, file_name=None):
    """Stands in for ``torch.hub.load_state_dict_from_url`` under mmengine's ``load_from_http`` (which
    ``open-mmlab://``, ``torchvision://`` and ``mmcls://`` also go through). torch's version loads with
    ``weights_only=False`` unless told otherwise, i.e. it would run a malicious pickle. Download and cache
    stay torch.hub's (``<TORCH_HOME>/hub/checkpoints/<basename>``, atomic ``download_url_to_file``);
    only the load is :func:`safe_torch_load`."""
    import os
    import os.path as osp
    from urllib.error import URLError
    from urllib.parse import urlparse
    model_dir = model_dir or osp.join(torch.hub.get_dir(), 'checkpoints')
    cached = osp.join(model_dir, file_name or osp.basename(urlparse(url).path))
    if not osp.exists(cached):
        os.makedirs(model_dir, exist_ok=True)
        hash_prefix = None
        if check_hash:
            match = torch.hub.HASH_REGEX.search(osp.basename(cached))
            hash_prefix = match.group(1) if match else None
        try:
            torch.hub.download_url_to_file(url, cached, hash_prefix, progress=progress)
        except (URLError, OSError, RuntimeError) as e:
            raise CheckpointReadError(f'cannot read checkpoint {url}: download failed '
                                      f'({_first_sentence(getattr(e, "reason", e))})') from None
    return safe_torch_load(cached, map_location=map_location, name=f'{url} (cached as {cached})')


def install_safe_loaders():
    """Route every mmengine checkpoint load (Runner ``load_from``/``resume``, ``Pretrained`` init,
    :class:`PretrainedBackbone`, ...) through :func:`safe_torch_load` (idempotent).

    Local paths: the ``''`` scheme of ``CheckpointLoader`` is re-registered (mmengine's calls
    ``torch.load`` without ``weights_only``: unsafe before torch 2.6). URLs: mmengine's ``load_from_http``
    (used by the ``http(s)://``, ``open-mmlab://``, ``torchvision://`` and ``mmcls://`` schemes) calls
    ``load_url``, bound at module level in ``mmengine.runner.checkpoint``; it is pointed at :func:`_load_url`,
    so those schemes keep mmengine's name tables, rank-0-first download and torch.hub's cache.
    """
    from mmengine.runner import checkpoint as mm_ckpt
    _patch_loaders(mm_ckpt)


def _patch_loaders(mm_ckpt):
    mm_ckpt.CheckpointLoader.register_scheme(prefixes='', loader=_load_from_local, force=True)
    mm_ckpt.load_url = _load_url


def install_safe_loaders_on_import():
    """:func:`install_safe_loaders` now if mmengine.runner.checkpoint is imported, else when it is."""
    from .lazy import patch_on_import
    patch_on_import('mmengine.runner.checkpoint', _patch_loaders)


def read_checkpoint(path, map_location='cpu', logger='current'):
    """Load a checkpoint from anything mmengine's ``CheckpointLoader`` takes (local path, ``https://``,
    ``open-mmlab://``, ``torchvision://``), weights-only. Errors are one line: ``FileNotFoundError`` for a
    missing local file, :class:`CheckpointReadError` otherwise (an unknown model name included)."""
    from mmengine.runner.checkpoint import _load_checkpoint
    install_safe_loaders()
    try:
        return _load_checkpoint(path, map_location=map_location, logger=logger)
    except KeyError as e:  # the name tables of open-mmlab:// / torchvision://
        raise CheckpointReadError(f'cannot read checkpoint {path}: unknown model name {e}') from None


def is_local_path(path) -> bool:
    return '://' not in str(path)


def check_checkpoint_path(path, what='checkpoint'):
    """Fail early, in one line, on a missing local file (URLs are checked when they are downloaded)."""
    import os.path as osp
    if path is not None and is_local_path(path) and not osp.isfile(osp.expanduser(path)):
        raise FileNotFoundError(f'{what} not found: {path}')
    return path


# --------------------------------------------------------------------------------------------------
# Strict loads: which tensors a checkpoint leaves at their initialization
# --------------------------------------------------------------------------------------------------
class CheckpointMismatchError(UserFixable, RuntimeError):
    """A checkpoint whose keys or shapes do not cover the model (a strict load refuses it)."""


def _unwrap(model):
    from mmengine.model import BaseTTAModel, is_model_wrapper
    while is_model_wrapper(model) or isinstance(model, BaseTTAModel):
        model = model.module
    return model


def state_dict_of(checkpoint, revise_keys=((r'^module\.', ''),)):
    """The model weights of a loaded checkpoint with mmengine's key revision (``module.`` stripped)."""
    import re
    state_dict = checkpoint.get('state_dict', checkpoint) if isinstance(checkpoint, dict) else checkpoint
    for pattern, repl in revise_keys:
        state_dict = {re.sub(pattern, repl, k): v for k, v in state_dict.items()}
    return state_dict


def load_mismatch(model, state_dict):
    """(missing, unexpected, mismatched) keys of loading ``state_dict`` into ``model`` (unwrapped from
    DDP / TTA wrappers). ``num_batches_tracked`` may be missing (mmengine ignores it too: checkpoints of
    older BN layers lack it), and so may a WSConv2d's ``_extra_state``; ``mismatched`` holds
    ``(key, checkpoint shape, model shape)``."""
    model = _unwrap(model)
    own = model.state_dict()
    # a WSConv2d's saved formula (_extra_state) is optional too: older checkpoints keep the configured one
    from .layers.ws import EXTRA_STATE_KEY, WSConv2d
    optional = {f'{n}.{EXTRA_STATE_KEY}' if n else EXTRA_STATE_KEY for n, m in model.named_modules()
                if isinstance(m, WSConv2d)}
    missing = [k for k in own if k not in state_dict and not k.endswith('num_batches_tracked') and k not in optional]
    unexpected = [k for k in state_dict if k not in own]
    mismatched = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state_dict.items()
                  if k in own and torch.is_tensor(v) and tuple(v.shape) != tuple(own[k].shape)]
    return missing, unexpected, mismatched


def _some(keys, limit=6):
    keys = list(keys)
    return ', '.join(map(str, keys[:limit])) + (f', ... ({len(keys)} in all)' if len(keys) > limit else '')


def describe_mismatch(missing, unexpected, mismatched) -> str:
    parts = []
    if missing:
        parts.append(f'missing keys {len(missing)} ({_some(missing)})')
    if mismatched:
        parts.append(f'shape-mismatched keys {len(mismatched)} ('
                     + _some(f'{k}: checkpoint {list(a)} vs model {list(b)}' for k, a, b in mismatched) + ')')
    if unexpected:
        parts.append(f'unexpected keys {len(unexpected)} ({_some(unexpected)})')
    return '; '.join(parts)




def norm_of_keys(keys) -> str:
    """The norm a state dict's keys hold, by the switch's names (``'bcn-ws'``, ``'gn-pn'``, ``'bn'``, ...): the
    most specific norm any module has, ``-ws`` where a conv records a WS formula (``_extra_state``); ``'gn'`` where
    no module keeps statistics or norm-specific parameters."""
    leaves = {k.rsplit('.', 1)[-1] for k in keys}
    norm = next((name for leaf, name in STATE_KEYS if leaf in leaves), 'gn')
    from .layers.ws import EXTRA_STATE_KEY
    return norm + '-ws' if EXTRA_STATE_KEY in leaves and norm in ('gn', 'bcn', 'bn') else norm


def norm_mismatch(model_keys, checkpoint_keys) -> Optional[str]:
    """Where the checkpoint holds another norm than the model (a run trained with ``--norm``, loaded with the
    config as written), what to say after "checkpoint NAME": both norms and the fix; else None."""
    held, built = norm_of_keys(checkpoint_keys), norm_of_keys(model_keys)
    from .layers.ws import EXTRA_STATE_KEY
    # saved before WS recorded its formula (_extra_state): the keys cannot tell WS apart
    if held == built or built == held + '-ws' and not any(k.endswith(EXTRA_STATE_KEY) for k in checkpoint_keys):
        return None
    return other_norm_line(held, built, f'--norm {held}' if held in CHOICES else f'the {held} config')


def other_norm_line(held: str, built: str, fix: str) -> str:
    """What to say after "checkpoint NAME" where it holds norm ``held`` and the config builds ``built``."""
    return (f'holds {held} layers and the config builds {built}: pass {fix} (as the run was trained with), or the '
            'config saved in its work dir')


def _debug() -> bool:
    from .errors import debug_requested
    return debug_requested()


def check_load(model, checkpoint, name, allow_partial=False, logger='current',
               hint='pass --allow-partial-load (or set allow_partial_load=True in the config)'):
    """Refuse (one line, on every rank) a checkpoint that would leave part of ``model`` at its
    initialization, or with ``allow_partial`` log at warning level every tensor that stays at its
    initialization. ``checkpoint``: a loaded checkpoint or a bare state dict. A checkpoint of another norm is
    one line naming both norms and the fix (``--debug``: with the keys), never a partial load's advice.
    ``hint``: how to load partially (None: no partial load is offered)."""
    from mmengine.logging import print_log
    state_dict = state_dict_of(checkpoint)
    missing, unexpected, mismatched = load_mismatch(model, state_dict)
    if not (missing or unexpected or mismatched):
        return
    what = describe_mismatch(missing, unexpected, mismatched)
    other_norm = norm_mismatch(_unwrap(model).state_dict().keys(), state_dict.keys())
    if other_norm and not allow_partial:
        raise CheckpointMismatchError(f'checkpoint {name} {other_norm}' + (f' ({what})' if _debug() else ''))
    if not allow_partial and hint is None:
        raise CheckpointMismatchError(f'checkpoint {name} does not match the model: {what}. Loads are strict: give '
                                      'the config the checkpoint was trained with')
    if not allow_partial:
        raise CheckpointMismatchError(
            f'checkpoint {name} does not match the model: {what}. Loads are strict; to load the matching '
            f'tensors and keep the rest at initialization, {hint}')
    stayed = missing + [k for k, _, _ in mismatched]
    print_log(f'PARTIAL LOAD of {name}: {len(stayed)} tensors stay at their initialization: '
              f'{", ".join(stayed) or "none"}; {what}', logger=logger, level=30)
