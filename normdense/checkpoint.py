"""Let mmengine 0.10.7 load its own Runner checkpoints on torch >= 2.6 without disabling ``weights_only``.

torch >= 2.6 loads with ``weights_only=True`` by default, and mmengine 0.10.7 calls ``torch.load``
without the argument. A Runner checkpoint pickles the message hub (``HistoryBuffer`` holding numpy
arrays) and numpy scalars in its meta, which the weights-only unpickler refuses. We allow-list exactly
those types; any other pickled class is still refused, so a malicious checkpoint stays harmless.
"""
import numpy as np
import torch


def _numpy_types():
    """numpy's array/scalar reconstruction entry points and the dtype classes a checkpoint may hold."""
    from numpy.core import multiarray as legacy_multiarray  # name used inside pickles (numpy 1 and 2)
    entries = [np.ndarray, np.dtype, legacy_multiarray._reconstruct, legacy_multiarray.scalar]
    # numpy 2 pickles dtypes as instances of per-dtype classes (numpy.dtypes.Float64DType, ...).
    dtype_classes = {type(np.dtype(t)) for t in (np.float16, np.float32, np.float64, np.int8, np.int16,
                                                   np.int32, np.int64, np.uint8, np.bool_)}
    entries += sorted(dtype_classes, key=lambda c: c.__name__)
    return entries


def mmengine_checkpoint_types():
    """The exact globals an mmengine Runner checkpoint needs beyond tensors and builtins."""
    from mmengine.logging.history_buffer import HistoryBuffer
    return [HistoryBuffer] + _numpy_types()


def allow_mmengine_checkpoint_types():
    """Register the types with ``torch.serialization.add_safe_globals`` (idempotent)."""
    add = getattr(torch.serialization, 'add_safe_globals', None)
    if add is None:  # torch < 2.4 has no weights-only default to work around
        return
    known = {id(t) for t in torch.serialization.get_safe_globals()}
    add([t for t in mmengine_checkpoint_types() if id(t) not in known])
