"""The StatNorm engine's plans: what a layer's call needs besides tensors (the backend, dtypes, the maps bound to the
layer's configuration, the activation in the backend's form), made once per (configuration, x's dtype and device,
backend state) in the process and shared by the layers of one configuration, so that a layer planned again for a
reason that does not change its plan (nn.DataParallel's replicas, made anew every step; a parameter set anew)
finds the plan, its serial and so its kept launches again (``kernels/launch.py``)."""
import functools
import itertools
from typing import Any, NamedTuple, Optional

import torch

from ..kernels import backend as _backend
from ..kernels import resolve
from ..kernels.backend import HALF as _HALF
from ..kernels.backend import Backend, Maps
from ..kernels.launch import stubbed


class _Plan(NamedTuple):
    """What a layer's call needs besides tensors, once per (x's dtype, x's device, backend state), cached on the
    layer (its ``__setattr__`` and ``_apply`` drop them): no per-call planning."""
    backend: Backend
    errors: tuple  # what the backend raises for a kernel that does not compile (ATen: none)
    cd: torch.dtype  # the compute dtype of the statistics
    out_dtype: torch.dtype
    convert: bool  # x3 goes to cd first (e.g. float32 x with float64 parameters)
    torch_maps: Maps  # the layer's maps in torch: ATen's, all-reduced statistics, fallbacks
    kernel_maps: Optional[Maps]  # the layer's kernel transcriptions where the backend runs them, else None
    activation: Any  # the layer's activation (GN+PN: an Activation), or None
    act: Any  # the activation as the backend's passes take it (``Backend.act_form``, made once here), or None
    # where launches are cached and must run (``launch.Launcher``): the CUDA index, -1 for stubbed launches on
    # the CPU, None where nothing is cached (ATen, the interpreter)
    device: Optional[int]
    serial: int  # this plan's number in the process: part of each call's launch-cache key
    direct: bool  # the kernel maps' backend: no torch code between the passes (autocast left as it is)


_SERIAL = itertools.count()
# why: equal configurations share one plan (and so their kept launches): a layer re-planned for a reason that
# does not change it (nn.DataParallel's replicas, made anew every step) finds its plan and its launches again
_PLANS = {}
_MAX_PLANS = 1024  # a safety net: the oldest dropped past it


def _fingerprint(obj):
    """A hashable stand-in for a plan's ingredients (partials of the maps, their configurations), equal where they
    are equal: the functions by identity, configurations by value (GN+PN's holds a dict)."""
    if isinstance(obj, functools.partial):
        return (_fingerprint(obj.func), _fingerprint(obj.args), _fingerprint(obj.keywords))
    if isinstance(obj, dict):
        return tuple(sorted((k, _fingerprint(v)) for k, v in obj.items()))
    if isinstance(obj, (tuple, list)):
        return (type(obj), ) + tuple(_fingerprint(o) for o in obj)
    try:
        hash(obj)
    except TypeError:
        return repr(obj)
    return obj


def plan_for(layer, x: torch.Tensor, key: tuple) -> _Plan:
    """``layer``'s plan for x (``key``: x's dtype, device and the backend state), from the process's table."""
    be = resolve(layer.backend, x)
    # everything make_plan reads: the maps as bound now (their configuration, the functions themselves), the
    # activation, the parameters' and output dtypes, the device
    # None: the backend runs no kernel maps, or the layer has none (its torch maps then run between the passes)
    kernel_maps = layer._coeff_maps(True) if be.kernel_maps else None
    maps = (Maps(*layer._coeff_maps(False)), None if kernel_maps is None else Maps(*kernel_maps))
    act = layer._statnorm_act()
    ident = (type(layer), _fingerprint(maps), act, be.name, stubbed(), layer._output_dtype(x),
             tuple(None if p is None else p.dtype for p in layer._statnorm_params()), _backend._device_of(x)) + key
    plan = _PLANS.get(ident)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        plan = _PLANS[ident] = make_plan(layer, x, be, *maps, act)
    return plan


def make_plan(layer, x: torch.Tensor, be, torch_maps, kernel_maps, act) -> _Plan:
    """The plan of ``layer`` for x on backend ``be`` with the maps and activation :func:`plan_for` bound."""
    params = layer._statnorm_params()
    cd, out_dtype = layer.stat_dtype(x, *params), layer._output_dtype(x)
    device = None
    where = _backend._device_of(x)
    if where.type == 'cuda' and be.kernel_maps:  # launches cached where they compile (the interpreter: none)
        device = where.index
    elif be.kernel_maps and stubbed():  # benchmarks/host.py: the cached path, its driver calls stubbed
        device = -1
    return _Plan(backend=be, errors=be.compile_errors(), cd=cd, out_dtype=out_dtype,
                 convert=x.dtype not in _HALF and x.dtype != cd, torch_maps=torch_maps, kernel_maps=kernel_maps,
                 activation=act, act=None if act is None else be.act_form(act), device=device, serial=next(_SERIAL),
                 direct=kernel_maps is not None)
