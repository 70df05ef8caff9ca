"""CPU-runnable detectors of what makes code slow or wrong on an accelerator.

``HostSyncRecorder`` (a ``TorchDispatchMode``) records, on any device, the ops that make a CUDA stream
wait for the host or the host wait for the GPU:

* ``aten._local_scalar_dense``: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``, ``if t:`` -- the
  host reads a value (a device-to-host copy and a full stream synchronization on CUDA);
* ``aten.lift_fresh``: a tensor made from Python data (``torch.tensor([...])``, ``x.new_tensor(...)``),
  a host-to-device copy that blocks the host on CUDA;
* ops whose output shape depends on values (``nonzero``, ``masked_select``, ``unique``, boolean-mask
  indexing, ``repeat_interleave`` with tensor repeats): CUDA must copy the size to the host;
* ``aten._linalg_check_errors`` and ``linalg_eigh``: solvers whose status is checked on the host.

Each event keeps the innermost normdense source line that issued it. ``.tolist()``, ``.cpu()`` and
``.numpy()`` do not pass through dispatch on a CPU tensor: the ``meta`` device check catches them
(``run_on_meta``), together with every tensor created on the CPU inside a forward or backward (mixing a
CPU tensor of more than zero dimensions with a meta tensor raises, as it would with a CUDA tensor) and
every value read (``Tensor.item() cannot be called on meta tensors``).
"""
import contextlib
import os.path as osp
import traceback
from typing import List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import normdense

_PKG = osp.dirname(osp.abspath(normdense.__file__))
_ALWAYS = {'_local_scalar_dense': 'host reads a value (.item()/float()/bool()/if on a tensor)',
           'item': 'host reads a value', 'is_nonzero': 'host reads a value (bool of a one-element tensor)',
           'lift_fresh': 'tensor from Python data (host-to-device copy)',
           'lift_fresh_copy': 'tensor from Python data (host-to-device copy)',
           'nonzero': 'output shape depends on values', 'masked_select': 'output shape depends on values',
           '_unique2': 'output shape depends on values', 'unique_dim': 'output shape depends on values',
           'unique_consecutive': 'output shape depends on values',
           '_linalg_check_errors': 'solver status checked on the host',
           '_linalg_eigh': 'solver status checked on the host (eigh)'}


def _where() -> str:
    """The innermost frame inside the normdense package (else the innermost non-torch frame)."""
    frames = traceback.extract_stack()[:-3]
    for f in reversed(frames):
        if f.filename.startswith(_PKG):
            return f'{osp.relpath(f.filename, osp.dirname(_PKG))}:{f.lineno} {f.line}'
    for f in reversed(frames):
        if '/torch/' not in f.filename:
            return f'{f.filename}:{f.lineno} {f.line}'
    return '?'


class HostSyncRecorder(TorchDispatchMode):
    """``with HostSyncRecorder() as rec: ...`` then ``rec.events``: ``(op, why, where)`` tuples."""

    def __init__(self):
        super().__init__()
        self.events: List[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        why = _ALWAYS.get(name)
        if why is None and name == 'repeat_interleave' and isinstance(args[0], torch.Tensor) \
                and 'output_size' not in kwargs:
            why = 'repeat_interleave with tensor repeats: output shape depends on values'
        if why is None and name in ('index', 'index_put', 'index_put_') and len(args) > 1 and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()):
            why = 'boolean-mask indexing: output shape depends on values'
        if why is not None:
            self.events.append((name, why, _where()))
        return func(*args, **kwargs)

    def report(self) -> str:
        return '\n'.join(f'  {op}: {why}\n    at {where}' for op, why, where in self.events)


def train_step(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One training-mode forward and backward (a fixed weighting of the output as the loss)."""
    module.train()
    x = x.detach().requires_grad_(True)
    out = module(x)
    weight = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view(out.shape)
    (out * weight).sum().backward()
    return out


def run_on_meta(module: torch.nn.Module, x: torch.Tensor, eval_too: bool = True) -> torch.Tensor:
    """Move ``module`` to the meta device and run a training forward + backward (and an eval forward) on
    ``x`` moved there: raises where the code creates a CPU tensor, moves data to the host or reads a value.
    """
    module = module.to('meta')
    xm = x.to('meta')
    with _autocast_off_accepts_meta():
        out = train_step(module, xm)
        assert out.device.type == 'meta'
        for p in module.parameters():
            assert p.grad is None or p.grad.device.type == 'meta'
        if eval_too:
            with torch.no_grad():
                module.eval()(xm)
    return out


@contextlib.contextmanager
def _autocast_off_accepts_meta():
    """The layers switch autocast off around their fp32 statistics with
    ``torch.autocast(x.device.type, enabled=False)``, which rejects the meta device (it has no autocast);
    there it has nothing to switch off, so it becomes a no-op for the duration."""
    real = torch.autocast

    def autocast(device_type, *args, **kwargs):
        if device_type == 'meta':
            return contextlib.nullcontext()
        return real(device_type, *args, **kwargs)

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


@contextlib.contextmanager
def fake_cuda(module: torch.nn.Module):
    """Give ``module`` fresh parameters and buffers of the same shapes on a *fake* CUDA device (torch's
    ``FakeTensorMode``, which works without a GPU: shapes, dtypes and devices only, no values) and yield
    it inside the mode. Code that mixes a CPU tensor with it fails as on a real GPU. Values are not
    computed: use it for code whose control flow does not depend on them (e.g. ``deploy.fuse``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # .to() of modules made inside the mode
    try:
        with FakeTensorMode():
            for m in module.modules():
                for n, p in list(m._parameters.items()):
                    if p is not None:
                        m._parameters[n] = torch.nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype, device='cuda'), p.requires_grad)
                for n, b in list(m._buffers.items()):
                    if b is not None:
                        m._buffers[n] = torch.empty(b.shape, dtype=b.dtype, device='cuda')
            yield module
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
