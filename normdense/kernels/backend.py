"""Which backend runs a StatNorm layer's passes: ``aten`` (ATen's kernels, every device) or ``triton``
(normdense's Triton kernels, CUDA; CPU tensors only under Triton's interpreter, ``TRITON_INTERPRET=1``).

The choice: the layer's ``backend`` option, else the environment variable ``NORMDENSE_BACKEND``, else
``auto``: Triton for CUDA tensors when triton imports and no kernel has failed to compile in this process,
else ATen. A kernel that fails to compile under ``auto`` makes the process fall back to ATen with one
warning; a forced ``triton`` raises instead. Imports no layer (and no triton until asked).
"""
import contextlib
import os
import warnings

BACKENDS = ('auto', 'aten', 'triton')
ENV = 'NORMDENSE_BACKEND'

# why: importing triton is tried once per process, and a failed compile gives Triton up for the process
_STATE = {'triton': None, 'broken': None}  # triton importable (None: not yet tried); why Triton was given up


def check_backend(value, who: str = 'backend'):
    """``value`` (None or one of BACKENDS) or a one-line ValueError naming the choices."""
    if value is not None and value not in BACKENDS:
        raise ValueError(f'{who} must be one of {BACKENDS} (or None: ${ENV}, default auto); got {value!r}')
    return value


def env_backend() -> str:
    value = os.environ.get(ENV, '').strip().lower() or 'auto'
    if value not in BACKENDS:
        raise ValueError(f'{ENV}={os.environ[ENV]!r}: choose one of {"|".join(BACKENDS)}')
    return value


def interpreted() -> bool:
    return os.environ.get('TRITON_INTERPRET') == '1'


def triton_error():
    """None if triton imports, else why not (one line)."""
    if _STATE['triton'] is None:
        try:
            import triton  # noqa: F401
            _STATE['triton'] = ''
        except Exception as e:  # ImportError, or a broken install
            _STATE['triton'] = f'triton does not import ({type(e).__name__}: {e})'.splitlines()[0]
    return _STATE['triton'] or None


def _choice(layer) -> str:
    """The layer's option, else the environment's."""
    return check_backend(getattr(layer, 'backend', None)) or env_backend()


def selected_backend(layer, x) -> str:
    """'aten' or 'triton' for ``layer`` on input ``x``."""
    choice = _choice(layer)
    if choice == 'aten':
        return 'aten'
    if choice == 'triton':
        reason = triton_error()
        if reason:
            raise RuntimeError(f"backend='triton' needs triton: {reason}; install torch's CUDA wheels (they ship "
                               f"triton) or use backend='aten'")
        if not (x.is_cuda or (x.device.type == 'cpu' and interpreted())):
            raise RuntimeError(f"backend='triton' runs on CUDA tensors (CPU ones only under TRITON_INTERPRET=1); "
                               f"got a {x.device.type} tensor: use backend='aten' or 'auto'")
        return 'triton'
    if x.is_cuda and _STATE['broken'] is None and triton_error() is None:
        return 'triton'
    return 'aten'


def device_guard(t):
    """The context in which a Triton launch for tensor ``t`` runs: ``torch.cuda.device(t.device)`` for a CUDA
    tensor (Triton launches on the current device and its current stream: without the guard, x on cuda:1 with
    cuda:0 current is an illegal access, or a kernel on the wrong stream), nothing for a CPU tensor (the
    interpreter)."""
    device = _device_of(t)
    if device.type != 'cuda':
        return contextlib.nullcontext()
    import torch
    return torch.cuda.device(device)


def _device_of(t):
    return t.device  # why a function: the tests fake a second CUDA device on CPU tensors


def compile_errors() -> tuple:
    """The exception types of a kernel that does not compile (Triton's frontend, ptxas, resources)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors
    return (CompilationError, ) + tuple(getattr(errors, n) for n in ('OutOfResources', 'PTXASError')
                                        if hasattr(errors, n))


def give_up_triton(option, error) -> None:
    """Under ``auto`` (``option``: the layer's backend option): ATen for the rest of the process, said once. A
    forced 'triton' re-raises."""
    if (check_backend(option) or env_backend()) == 'triton':
        raise error
    if _STATE['broken'] is None:
        _STATE['broken'] = f'{type(error).__name__}: {error}'.splitlines()[0]
        warnings.warn(f'normdense: a Triton kernel failed to compile ({_STATE["broken"]}); using the ATen '
                      f'backend for the rest of this process (set {ENV}=aten to silence this)', RuntimeWarning,
                      stacklevel=3)
