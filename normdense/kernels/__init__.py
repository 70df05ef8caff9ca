"""The StatNorm engine's backends, below the layers: nothing here imports ``normdense.layers``.

``backend.py`` declares the backend contract (a Protocol and its records) and which backend runs, ``resolve``
(here) gives it; ``aten.py`` (torch
operators) and ``triton.py`` (the Triton kernels' launchers) implement it; ``torch_op.py`` is the operator a layer's
call becomes under torch.compile. The Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``):
``passes.py`` the passes over the activation, ``first_stage.py`` the statistics (alone or folded into a map
kernel), ``bcn.py``, ``proxy_norm.py``, ``unitization.py`` each layer's coefficient map and VJP,
``activations.py`` GN+PN's phi, ``common.py`` what they share (float arguments, tiles, block sizes, the
second stage). Importing this package imports no triton.
"""
from . import backend as _backend


def resolve(option, x):
    """The backend (a ``backend.Backend``) that runs a layer with ``backend`` option ``option`` on input ``x``: the
    option, else ``$NORMDENSE_BACKEND``, else auto (``backend.backend_name``). The engine asks once per layer and
    input dtype and device (its plan): a changed environment variable is seen by layers and inputs new to it."""
    if _backend.backend_name(option, x) == 'aten':
        from .aten import AtenBackend
        return AtenBackend
    from .triton import TritonBackend  # triton imported only when it runs
    return TritonBackend
