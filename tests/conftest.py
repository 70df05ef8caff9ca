"""Tests marked ``cuda`` need a GPU: without one they are reported as skipped ("needs CUDA: not run"),
never as passed, so ``pytest -ra`` lists every one of them. Tests marked ``mmengine`` are reported likewise
("needs mmengine: not installed") where it does not import, e.g. on a GPU machine with torch and triton only
(``NORMDENSE_LAYERS_ONLY=1``, scripts/gpu_check.sh).

Without a GPU, Triton's kernels run on CPU tensors in its interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test imports them (``triton.jit`` reads it when a kernel is defined); tests/kernels/."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')


def _has_mmengine() -> bool:
    try:
        import mmengine  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    # not item.keywords: it holds 'cuda' of tests/cuda/
    skips = {'cuda': None if torch.cuda.is_available() else 'needs CUDA: not run',
             'mmengine': None if _has_mmengine() else 'needs mmengine: not installed (a torch-only machine)'}
    for marker, reason in skips.items():
        if reason is None:
            continue
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
