"""Triton kernels of the StatNorm engine (CUDA; on CPU tensors under Triton's interpreter, ``TRITON_INTERPRET=1``).

Kernels below, layers above: nothing here imports ``normdense.layers``. ``passes.py`` holds the passes over
the activation (moments, apply, sums, dx) and the first-stage statistics; ``bcn.py``, ``proxy_norm.py`` and
``unitization.py`` the channel-sized coefficient maps of each layer and their closed-form VJPs (each one
launch, the Triton transcription of the layer's ``coeff_map`` / ``coeff_vjp``); ``activations.py`` the
activations phi of GN+PN; ``scalars.py`` float arguments at float64 accuracy. Importing this package
imports no triton: the modules do.
"""
