"""The one place where normdense registers into mmengine's root registries.

mmcv has no registry of its own: its bricks (``build_norm_layer``, ``build_conv_layer``) and mmdet's,
mmseg's and mmpretrain's child registries all resolve through mmengine's root ``MODELS``, so one
registration here makes a layer selectable from any of their configs. Names already taken there
(mmcv's ``ConvWS``, ``GN``, ...) raise ``KeyError``, so ours are new.
"""
from mmengine.registry import HOOKS, MODELS, WEIGHT_INITIALIZERS  # noqa: F401

from .convert.pretrained_init import PretrainedBackbone  # noqa: E402

WEIGHT_INITIALIZERS.register_module(name='PretrainedBackbone', module=PretrainedBackbone)

from .hooks.strict_load import StrictLoadHook  # noqa: E402

HOOKS.register_module(name='StrictLoadHook', module=StrictLoadHook)

# --- Weight Standardization and Batch-Channel Normalization (WS/BCN paper) -------------------------
from .hooks.estimate_rate import BCNRateHook, EstimateRateHook  # noqa: E402
from .layers.bcn import BatchChannelNorm2d  # noqa: E402
from .layers.ws import WSConv2d  # noqa: E402

MODELS.register_module(name='WSConv2d', module=WSConv2d)
MODELS.register_module(name='BCN', module=BatchChannelNorm2d)
HOOKS.register_module(name='EstimateRateHook', module=EstimateRateHook)
HOOKS.register_module(name='BCNRateHook', module=BCNRateHook)  # the first name, kept for configs

# --- Unitization, EquiNorm and the diagnostics hook (Unitization / EquiNorm papers) ----------------
from .hooks.diagnostics import NormDiagnosticsHook  # noqa: E402
from .layers.equinorm import ChannelAffine, EquiConv2d  # noqa: E402
from .layers.unitization import Unitization2d  # noqa: E402

MODELS.register_module(name='Unitization', module=Unitization2d)
MODELS.register_module(name='EquiConv2d', module=EquiConv2d)
MODELS.register_module(name='ChannelAffine', module=ChannelAffine)
HOOKS.register_module(name='NormDiagnosticsHook', module=NormDiagnosticsHook)

# --- Proxy Normalization and IterNorm (PN / IterNorm papers) ---------------------------------------
from .codebases import lazy_backbone  # noqa: E402
from .hooks.proxy_norm_check import ProxyNormCheckHook  # noqa: E402
from .layers.iternorm import IterNorm  # noqa: E402
from .layers.proxy_norm import GroupProxyNorm  # noqa: E402

# PNResNet subclasses mmseg's ResNet (mmdet's without mmseg): importing either takes seconds and needs
# mmcv's ops, so `import normdense` registers stand-ins that import the backbone on first build (it then
# registers the real classes in their place); with neither codebase they raise a one-line error.
PNResNet, PNResNetV1c = lazy_backbone('PNResNet'), lazy_backbone('PNResNetV1c')

MODELS.register_module(name='GNPN', module=GroupProxyNorm)
MODELS.register_module(name='IterNorm', module=IterNorm)
MODELS.register_module(name='PNResNet', module=PNResNet)
MODELS.register_module(name='PNResNetV1c', module=PNResNetV1c)
HOOKS.register_module(name='ProxyNormCheckHook', module=ProxyNormCheckHook)
