"""Hook that fails fast when an activation is applied on top of a GNPN layer.

Proxy Normalization's layer (``GNPN``) already contains the activation (Eq. 7 of the PN paper), so
a config that keeps the usual activation after it (mmcv ``ConvModule`` with the default
``act_cfg=dict(type='ReLU')``, mmdet/mmseg ``ResNet`` blocks, ``Sequential(norm, ReLU)``) silently
builds a different model. Where to check:

* Inside ``GNPN`` at build time the layer cannot see which activation its parent adds; checking
  inside ``ConvModule`` would mean patching mmcv. So the check runs on the **built model**.
* ``before_run``: static check of the module tree (ConvModule ``order``/``act_cfg`` and
  ``nn.Sequential`` neighbours), before any training happens.
* First training iteration: module hooks watch which activation modules receive a PN output
  (catches ReLUs called inside ``forward`` code, e.g. using ``ResNet`` instead of ``PNResNet``);
  the hooks are removed after that iteration, so later iterations cost nothing.

Both raise ``ValueError`` naming the offending modules. ``configs/_base_/proxy_norm.py`` adds this
hook; the same checks are available as plain functions here (:func:`check_proxy_norm_placement`,
:class:`ActivationAfterProxyNormGuard`), as is :func:`proxy_norm_paramwise_cfg`, the optimizer side of
that base config.
"""
import os.path as osp
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import is_model_wrapper

from ..layers.proxy_norm import GroupProxyNorm

# The paramwise_cfg has one copy: the dict in this base config. Configs cannot call into normdense (an
# old-style mmengine config that imports a package becomes a lazy-import config, which the old-style
# configs inheriting it cannot mix with), so the Python helper reads the config instead.


def proxy_norm_base_config() -> str:
    """``configs/_base_/proxy_norm.py`` of the checkout, or of ``normdense/.mim`` in a wheel install."""
    from ..tools import configs_dir
    return osp.join(configs_dir(), '_base_', 'proxy_norm.py')


def proxy_norm_paramwise_cfg(norm_decay_mult: Optional[float] = None,
                             proxy_decay_mult: Optional[float] = None) -> dict:
    """mmengine ``paramwise_cfg`` giving PN's weight-decay treatment: ``configs/_base_/proxy_norm.py``'s
    ``optim_wrapper.paramwise_cfg`` (``norm_decay_mult=0``, ``decay_mult=1`` for the proxy parameters),
    with ``norm_decay_mult`` / the proxy parameters' ``decay_mult`` replaced where given.

    With the defaults, weight decay among the norm parameters applies only to PN's beta~/gamma~
    (``proxy_beta``/``proxy_gamma``): mmengine's ``norm_decay_mult`` covers every ``GroupNorm``
    subclass (so GNPN's gamma/beta and the plain GN/BN layers get ``norm_decay_mult``), and
    ``custom_keys`` take precedence over it for the proxy parameters. Convolution/linear weights
    keep the base decay. This is the paper's EfficientNet recipe (App. A.1: decay "on the
    convolutional weights and the additional parameters beta~, gamma~ of PN, but not on the other
    channel-wise parameters"). The paper's ResNet recipe decays *all* parameters including
    gamma/beta: that is mmengine's default (no paramwise_cfg) or ``norm_decay_mult=1.0`` here.

    Use as ``optim_wrapper = dict(..., paramwise_cfg=proxy_norm_paramwise_cfg())`` in code that builds
    its optimizer itself; configs inherit ``configs/_base_/proxy_norm.py`` (found in a source checkout
    and, through ``normdense/.mim``, in a wheel install).
    """
    from mmengine.config import Config
    cfg = Config.fromfile(proxy_norm_base_config()).optim_wrapper.paramwise_cfg.to_dict()
    if norm_decay_mult is not None:
        cfg['norm_decay_mult'] = norm_decay_mult
    if proxy_decay_mult is not None:
        for key in ('.proxy_beta', '.proxy_gamma'):
            cfg['custom_keys'][key]['decay_mult'] = proxy_decay_mult
    return cfg


# Detecting "activation right after PN" (PN already contains phi; a second activation would silently change
# the model).
# mmcv's own activation bricks (mmcv.cnn.bricks) that do not live in torch.nn.modules.activation
_EXTRA_ACTIVATION_NAMES = {'Swish', 'HSwish', 'HSigmoid', 'Clamp', 'Clip', 'GELU', 'SiLU'}


def _is_activation(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):  # lives in torch.nn.modules.activation too
        return False
    return any(c.__module__ == 'torch.nn.modules.activation' or c.__name__ in
               _EXTRA_ACTIVATION_NAMES for c in type(module).__mro__[:-1])


def _describe(module: nn.Module) -> str:
    return type(module).__name__


def find_activations_after_proxy_norm(model: nn.Module) -> List[str]:
    """Static check: structures that apply an activation module directly to a PN output.

    Recognised structures: mmcv ``ConvModule`` (duck-typed: ``order``, ``with_activation``,
    ``norm_name``) whose norm is a :class:`GroupProxyNorm` and whose ``'act'`` comes right after
    ``'norm'`` in ``order``; and ``nn.Sequential`` containers with a PN child directly followed by
    an activation child. Activations applied inside a module's ``forward`` code (e.g. the ReLU of
    mmdet's ``ResNet`` blocks) are invisible here: :class:`ActivationAfterProxyNormGuard` catches
    those at run time. Returns one message per offending place (empty list: nothing found).
    """
    problems = []
    for name, m in model.named_modules():
        where = name or '<model>'
        order = getattr(m, 'order', None)
        norm_name = getattr(m, 'norm_name', None)
        if (isinstance(order, (tuple, list)) and isinstance(norm_name, str)
                and getattr(m, 'with_norm', False) and getattr(m, 'with_activation', False)
                and 'norm' in order and 'act' in order):
            norm = getattr(m, norm_name, None)
            if (isinstance(norm, GroupProxyNorm)
                    and list(order).index('act') == list(order).index('norm') + 1):
                act = getattr(m, 'activate', None)
                problems.append(
                    f'{where} ({_describe(m)}): {_describe(act)} applied after its '
                    f'{_describe(norm)} norm. PN already contains the activation: set '
                    f"act_cfg=None for this module (or use a plain norm such as dict(type='GN') "
                    f'if the module does not accept act_cfg)')
        if isinstance(m, nn.Sequential):
            children = list(m.named_children())
            for (n1, c1), (n2, c2) in zip(children, children[1:]):
                if isinstance(c1, GroupProxyNorm) and _is_activation(c2):
                    prefix = f'{name}.' if name else ''
                    problems.append(
                        f'{prefix}{n2} ({_describe(c2)}) directly follows the PN layer '
                        f'{prefix}{n1}: PN already contains the activation, remove it '
                        f'(e.g. nn.Identity())')
    return problems


def check_proxy_norm_placement(model: nn.Module) -> None:
    """Raise ``ValueError`` listing every place found by :func:`find_activations_after_proxy_norm`."""
    problems = find_activations_after_proxy_norm(model)
    if problems:
        raise ValueError('Activation applied on top of a proxy-normalized activation step '
                         '(GNPN):\n  ' + '\n  '.join(problems))


class ActivationAfterProxyNormGuard:
    """Run-time check for one forward pass: an activation *module* receiving a PN output.

    Catches what the static check cannot see, e.g. ``ResNet`` blocks that call ``self.relu`` on
    ``self.norm1(x)`` inside ``forward``. Uses module-local hooks (PN forward hooks record their
    output tensors; activation pre-hooks test whether their input *is* one of them), removed on
    exit; on a clean exit with violations it raises ``ValueError``. Functional activations
    (``F.relu(x)``) are not modules and cannot be seen::

        with ActivationAfterProxyNormGuard(model):
            model(inputs)
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.problems: List[str] = []
        self._handles = []
        self._outputs: Dict[int, Tuple[str, weakref.ref]] = {}

    def _record(self, name):
        def hook(module, args, output):
            if isinstance(output, torch.Tensor):
                self._outputs[id(output)] = (name, weakref.ref(output))
        return hook

    def _check(self, name):
        def pre_hook(module, args):
            for arg in args:
                if not isinstance(arg, torch.Tensor):
                    continue
                hit = self._outputs.get(id(arg))
                if hit is not None and hit[1]() is arg:
                    msg = (f'{name} ({_describe(module)}) is applied to the output of the PN layer '
                           f'{hit[0]}: PN already contains the activation (use act_cfg=None in '
                           f'ConvModules, PNResNet instead of ResNet)')
                    if msg not in self.problems:
                        self.problems.append(msg)
        return pre_hook

    def __enter__(self):
        for name, m in self.model.named_modules():
            if isinstance(m, GroupProxyNorm):
                self._handles.append(m.register_forward_hook(self._record(name)))
            elif _is_activation(m):
                self._handles.append(m.register_forward_pre_hook(self._check(name)))
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._outputs = {}

    def __exit__(self, exc_type, exc, tb):
        self.remove()
        if exc_type is None and self.problems:
            raise ValueError('Activation applied on top of a proxy-normalized activation step '
                             '(GNPN):\n  ' + '\n  '.join(self.problems))
        return False




class ProxyNormCheckHook(Hook):
    """Static check before the run, run-time check during the first training iteration.

    Args:
        check_forward: also run :class:`ActivationAfterProxyNormGuard` on the first training
            iteration.
    """
    priority = 'VERY_HIGH'

    def __init__(self, check_forward: bool = True):
        self.check_forward = check_forward
        self._guard = None
        self._forward_checked = False

    @staticmethod
    def _model(runner):
        model = runner.model
        return model.module if is_model_wrapper(model) else model

    def before_run(self, runner) -> None:
        check_proxy_norm_placement(self._model(runner))

    def before_train_iter(self, runner, batch_idx: int, data_batch=None) -> None:
        if self.check_forward and not self._forward_checked and self._guard is None:
            self._guard = ActivationAfterProxyNormGuard(self._model(runner)).__enter__()

    def after_train_iter(self, runner, batch_idx: int, data_batch=None, outputs=None) -> None:
        if self._guard is not None:
            guard, self._guard = self._guard, None
            self._forward_checked = True
            guard.__exit__(None, None, None)  # raises ValueError if a violation was seen
