"""ResNet whose "norm -> ReLU" pairs are proxy-normalized activation steps (GN+PN).

Proxy Normalization ("Proxy-Normalizing Activations to Match Batch Normalization while Removing Batch
Dependence", arXiv:2106.03743, Sec. 5) replaces the activation step that
directly follows a norm by the proxy-normalized activation step of Eq. 7, which contains the
activation. OpenMMLab ResNets hard-code ``nn.ReLU`` after their norms, so PN needs its own wiring:

* stem norm(s) (``norm1``/``gn1``, or the three norms of the ``deep_stem``), ``norm1`` and ``norm2``
  of ``Bottleneck`` and ``norm1`` of ``BasicBlock`` are built from ``norm_cfg`` (a GNPN cfg) and
  the ReLU that followed them is removed;
* the norm before the residual add (``norm3`` of ``Bottleneck``, ``norm2`` of ``BasicBlock``) and
  the norm of the downsample branch have no activation after them: they stay plain affine norms
  (``plain_norm_cfg``, by default ``dict(type='GN')`` with GNPN's ``num_groups``/``eps``);
* the ReLU after the residual add stays: no norm immediately precedes it, which is exactly where
  the paper does not apply PN (Sec. 5, App. A.1). For the same reason there is no PN right before
  the final pooling of this v1 ResNet, so PN's "disable scaling before pooling" does not arise.

The classes subclass mmseg's ``ResNet``/``BasicBlock``/``Bottleneck`` (mmseg's ResNet is the
superset of mmdet's: it also takes ``contract_dilation``/``multi_grid`` used by DeepLabV3 configs), or
mmdet's in an environment without mmseg (same attributes, blocks and stem; detection configs pass no
mmseg-only argument), and only override block ``forward`` and the stem's ReLU. Attribute names are those of a GN ResNet
(``conv1``, ``gn1``, ``layer1.0.gn3``, ``layer1.0.downsample.1``, ``stem.1``, ...), so GN
checkpoints load by key; only the PN parameters ``proxy_beta``/``proxy_gamma`` are new (init 0).

Registered in mmengine's root ``MODELS`` as ``PNResNet`` and ``PNResNetV1c`` (deep stem, like
mmseg's ``ResNetV1c``), hence buildable from mmdet, mmseg and mmpretrain configs alike. mmpretrain-
only ResNet arguments (``drop_path_rate``, ``expansion``) are not accepted.
"""
import copy
import inspect

import torch.nn as nn
import torch.utils.checkpoint as cp
from mmcv.cnn import build_norm_layer
from mmengine.registry import MODELS

from ...codebases import is_installed, require
from ...layers.proxy_norm import GroupProxyNorm

# require(): a one-line error when the codebase is missing or its import fails on mmcv's ops
_resnet = require('mmseg.models.backbones.resnet' if is_installed('mmseg')
                  else 'mmdet.models.backbones.resnet', 'PNResNet')  # mmdet: detection-only environment
BasicBlock, Bottleneck, ResNet = _resnet.BasicBlock, _resnet.Bottleneck, _resnet.ResNet

__all__ = ['PNBasicBlock', 'PNBottleneck', 'PNResNet', 'PNResNetV1c']


def _replace_norm(block: nn.Module, name_attr: str, norm_cfg: dict, channels: int,
                  postfix: int) -> None:
    """Rebuild the norm stored under ``getattr(block, name_attr)`` from ``norm_cfg``."""
    old_name = getattr(block, name_attr)
    new_name, layer = build_norm_layer(norm_cfg, channels, postfix=postfix)
    if new_name != old_name:
        delattr(block, old_name)
    block.add_module(new_name, layer)  # same name: replaced in place, registration order kept
    setattr(block, name_attr, new_name)


def _run(block: nn.Module, inner, x):
    if block.with_cp and x.requires_grad:
        return cp.checkpoint(inner, x, use_reentrant=False)
    return inner(x)


class PNBasicBlock(BasicBlock):
    """BasicBlock: conv1 -> PN step (norm1) -> conv2 -> plain norm2 -> (+ identity) -> ReLU.

    ``norm_cfg`` is the plain affine norm (norm2, downsample), ``pn_norm_cfg`` the PN step.
    """

    def __init__(self, inplanes, planes, *args, pn_norm_cfg, **kwargs):
        super().__init__(inplanes, planes, *args, **kwargs)
        _replace_norm(self, 'norm1_name', pn_norm_cfg, planes, 1)

    def forward(self, x):

        def _inner_forward(x):
            identity = x
            out = self.norm1(self.conv1(x))  # includes the activation
            out = self.norm2(self.conv2(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            return out + identity

        return self.relu(_run(self, _inner_forward, x))


class PNBottleneck(Bottleneck):
    """Bottleneck: conv1 -> PN (norm1) -> conv2 -> PN (norm2) -> conv3 -> plain norm3 -> add -> ReLU.

    ``norm_cfg`` is the plain affine norm (norm3, downsample), ``pn_norm_cfg`` the PN steps.
    Plugins run at the same places as in mmseg's Bottleneck.
    """

    def __init__(self, inplanes, planes, *args, pn_norm_cfg, **kwargs):
        super().__init__(inplanes, planes, *args, **kwargs)
        _replace_norm(self, 'norm1_name', pn_norm_cfg, planes, 1)
        _replace_norm(self, 'norm2_name', pn_norm_cfg, planes, 2)

    def _plugins(self, x, names_attr):
        if not self.with_plugins:
            return x
        return self.forward_plugin(x, getattr(self, names_attr))

    def forward(self, x):

        def _inner_forward(x):
            identity = x
            out = self.norm1(self.conv1(x))  # includes the activation
            out = self._plugins(out, 'after_conv1_plugin_names')
            out = self.norm2(self.conv2(out))  # includes the activation
            out = self._plugins(out, 'after_conv2_plugin_names')
            out = self.norm3(self.conv3(out))
            out = self._plugins(out, 'after_conv3_plugin_names')
            if self.downsample is not None:
                identity = self.downsample(x)
            return out + identity

        return self.relu(_run(self, _inner_forward, x))


def _norm_class(norm_cfg: dict):
    layer_type = norm_cfg.get('type') if isinstance(norm_cfg, dict) else None
    if inspect.isclass(layer_type):
        return layer_type
    if not isinstance(layer_type, str):
        return None
    # resolve like mmcv's build_norm_layer does (root registry, current scope ignored)
    with MODELS.switch_scope_and_registry(None) as registry:
        return registry.get(layer_type)


def default_plain_norm_cfg(pn_norm_cfg: dict) -> dict:
    """GN with the GNPN cfg's ``num_groups`` (default 32), ``eps`` and ``requires_grad``."""
    groups, per_group = pn_norm_cfg.get('num_groups', 32), pn_norm_cfg.get('channels_per_group')
    if isinstance(groups, int) and per_group is None:
        plain = dict(type='GN', num_groups=groups)  # exact, as the GNPN layers
    else:  # the same group policy as the GNPN layers (layers/groups.py)
        plain = dict(type='GNAuto', num_groups=groups, channels_per_group=per_group)
    for key in ('eps', 'requires_grad'):
        if key in pn_norm_cfg:
            plain[key] = pn_norm_cfg[key]
    return plain


class PNResNet(ResNet):
    """mmseg's (else mmdet's) ``ResNet`` with GN+PN steps in place of every "norm -> ReLU" (see module docstring).

    Args:
        depth: 18, 34, 50, 101 or 152.
        norm_cfg: cfg of the proxy-normalized activation step; its type must build a
            :class:`~normdense.layers.proxy_norm.GroupProxyNorm` (``'GNPN'``), e.g.
            ``dict(type='GNPN', num_groups=32)``.
        plain_norm_cfg: cfg of the affine norms that precede the residual add (``norm3`` /
            BasicBlock ``norm2``) and of the downsample branch. Default: GN with the same
            ``num_groups``/``eps`` (see :func:`default_plain_norm_cfg`).
        **kwargs: every other argument of mmseg's ``ResNet`` (``deep_stem``, ``dilations``,
            ``strides``, ``contract_dilation``, ``frozen_stages``, ``init_cfg``, ...).

    ``zero_init_residual=True`` (default) zero-initialises the plain norm before each residual add,
    as mmdet/mmseg do for their own blocks.
    """

    arch_settings = {
        18: (PNBasicBlock, (2, 2, 2, 2)),
        34: (PNBasicBlock, (3, 4, 6, 3)),
        50: (PNBottleneck, (3, 4, 6, 3)),
        101: (PNBottleneck, (3, 4, 23, 3)),
        152: (PNBottleneck, (3, 8, 36, 3)),
    }

    def __init__(self, depth, norm_cfg=dict(type='GNPN', num_groups=32), plain_norm_cfg=None,
                 **kwargs):
        if not isinstance(norm_cfg, dict) or 'type' not in norm_cfg:
            raise ValueError(f'PNResNet: norm_cfg must be a dict with a "type", got {norm_cfg!r}')
        cls = _norm_class(norm_cfg)
        if not (inspect.isclass(cls) and issubclass(cls, GroupProxyNorm)):
            raise ValueError(
                f"PNResNet: norm_cfg must build a proxy-norm layer (type='GNPN'), got "
                f"type={norm_cfg['type']!r}. Its ReLUs are folded into the norm, so a plain norm "
                f"would lose them; use ResNet for plain norms.")
        norm_cfg = copy.deepcopy(norm_cfg)
        # Needed by make_res_layer, which mmseg's ResNet.__init__ calls: set before super().__init__
        # (plain attributes are allowed on an nn.Module before Module.__init__).
        self.plain_norm_cfg = (copy.deepcopy(plain_norm_cfg) if plain_norm_cfg is not None else
                               default_plain_norm_cfg(norm_cfg))
        super().__init__(depth, norm_cfg=norm_cfg, **kwargs)
        init_cfg = kwargs.get('init_cfg')
        pretrained = kwargs.get('pretrained')
        if self.zero_init_residual and init_cfg is None and pretrained is None:
            # mmseg's ResNet only recognises its own block classes (`block is Bottleneck`)
            last = 'norm2' if self.block is PNBasicBlock else 'norm3'
            for layer_name in self.res_layers:
                for block in getattr(self, layer_name):
                    block.init_cfg = dict(type='Constant', val=0, override=dict(name=last))

    def train(self, mode=True):
        # mmseg's ResNet.train returns None; nn.Module.train (and model.eval()) returns the module
        super().train(mode)
        return self

    def make_res_layer(self, **kwargs):
        # ResLayer passes norm_cfg to the downsample norm and to the blocks, and forwards unknown
        # kwargs to the blocks: the plain norm goes everywhere, the PN cfg only to the blocks.
        kwargs['pn_norm_cfg'] = kwargs['norm_cfg']
        kwargs['norm_cfg'] = self.plain_norm_cfg
        return super().make_res_layer(**kwargs)

    def _make_stem_layer(self, in_channels, stem_channels):
        super()._make_stem_layer(in_channels, stem_channels)  # stem norms built from the PN cfg
        if self.deep_stem:
            # Sequential(conv, norm, ReLU) x 3: keep indices (checkpoint keys), drop the ReLUs
            for i, m in enumerate(self.stem):
                if isinstance(m, nn.ReLU):
                    self.stem[i] = nn.Identity()
        else:
            self.relu = nn.Identity()  # ResNet.relu is only used right after the stem norm


class PNResNetV1c(PNResNet):
    """PNResNet with the deep stem (three 3x3 convs) of mmseg's ``ResNetV1c`` (DeepLabV3 configs)."""

    def __init__(self, **kwargs):
        super().__init__(deep_stem=True, avg_down=False, **kwargs)

