"""The one place where normdense registers into mmengine's root registries.

mmcv has no registry of its own: its bricks (``build_norm_layer``, ``build_conv_layer``) and mmdet's,
mmseg's and mmpretrain's child registries all resolve through mmengine's root ``MODELS``, so one
registration here makes a layer selectable from any of their configs. Names already taken there
(mmcv's ``ConvWS``, ``GN``, ...) raise ``KeyError``, so ours are new.
"""
from mmengine.registry import HOOKS, MODELS  # noqa: F401

# --- Weight Standardization and Batch-Channel Normalization (WS/BCN paper) -------------------------
from .hooks.bcn_rate import BCNRateHook  # noqa: E402
from .layers.bcn import BatchChannelNorm2d  # noqa: E402
from .layers.ws import WSConv2d  # noqa: E402

MODELS.register_module(name='WSConv2d', module=WSConv2d)
MODELS.register_module(name='BCN', module=BatchChannelNorm2d)
HOOKS.register_module(name='BCNRateHook', module=BCNRateHook)
