"""The kernel tests run the real Triton kernels: on CUDA tensors where torch sees a GPU (and the interpreter is
not asked for), else on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py
before anything imports triton's kernels). Without triton they are reported as skipped ("needs triton")."""
import os

import pytest
import torch

INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'
DEVICE = 'cpu' if INTERPRETED or not torch.cuda.is_available() else 'cuda'


def pytest_collection_modifyitems(config, items):
    try:
        import triton  # noqa: F401
    except ImportError:
        skip = pytest.mark.skip(reason='needs triton: not run')
        for item in items:
            if 'tests/kernels' in str(item.fspath):
                item.add_marker(skip)


@pytest.fixture
def device():
    """Where the kernels run: 'cuda' on a GPU machine, else 'cpu' (the interpreter)."""
    return DEVICE
