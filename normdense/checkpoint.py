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

import numpy as np
import torch


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
