"""The StatNorm engine's backends, below the layers: nothing here imports ``normdense.layers``.

``backend.py`` picks a backend; ``aten.py`` and ``triton.py`` implement the engine's interface (moments, stats,
apply, sums, dx); ``torch_op.py`` is the operator a layer's call becomes under torch.compile. The Triton kernels
(CUDA; CPU tensors under ``TRITON_INTERPRET=1``): ``passes.py`` over the activation, ``bcn.py``,
``proxy_norm.py``, ``unitization.py`` each layer's coefficient map and VJP, ``activations.py`` GN+PN's phi,
``scalars.py`` float arguments at float64 accuracy. Importing this package imports no triton.
"""
