"""Tests marked ``cuda`` need a GPU: without one they are reported as skipped ("needs CUDA: not run"),
never as passed, so ``pytest -ra`` lists every one of them.

Without a GPU, Triton's kernels run on CPU tensors in its interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test imports them (``triton.jit`` reads it when a kernel is defined); tests/kernels/."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs CUDA: not run')
    for item in items:
        if item.get_closest_marker('cuda') is not None:  # not item.keywords: it holds 'cuda' of tests/cuda/
            item.add_marker(skip)
