"""The StatNorm engine's backends, below the layers: nothing here imports ``normdense.layers``.

``backend.py`` declares the backend contract (a Protocol and its records) and picks a backend; ``aten.py`` (torch
operators) and ``triton.py`` (the Triton kernels' launchers) implement it; ``torch_op.py`` is the operator a layer's
call becomes under torch.compile. The Triton kernels (CUDA; CPU tensors under ``TRITON_INTERPRET=1``):
``passes.py`` the passes over the activation, ``first_stage.py`` the statistics (alone or folded into a map
kernel), ``bcn.py``, ``proxy_norm.py``, ``unitization.py`` each layer's coefficient map and VJP,
``activations.py`` GN+PN's phi, ``common.py`` what they share (float arguments, tiles, block sizes, the
second stage). Importing this package imports no triton.
"""
