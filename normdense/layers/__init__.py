"""Plain nn.Module implementations, one file per paper method (registered in normdense/registry.py).

The layer classes are exported here, as timm's and mmcv's ``__init__`` do: ``from normdense.layers import
BatchChannelNorm2d, WSConv2d``.
"""
from ._estimate import EstimateRateMixin, mark_iteration, set_update_rate  # noqa: F401  (estimate mode, shared)
from ._statnorm import StatNorm2d, set_fused  # noqa: F401  (the engine of BCN, GN+PN, Unitization; fused on / off)
from .bcn import BatchChannelNorm2d  # noqa: F401
from .equinorm import ChannelAffine, EquiConv2d  # noqa: F401
from .groups import GroupNorm, resolve_groups  # noqa: F401  (the group policy of GN, BCN, GN+PN)
from .iternorm import IterNorm  # noqa: F401
from .proxy_norm import GroupProxyNorm  # noqa: F401
from .unitization import Unitization2d  # noqa: F401
from .ws import WSConv2d, standardize_weight  # noqa: F401

__all__ = ['BatchChannelNorm2d', 'ChannelAffine', 'EquiConv2d', 'EstimateRateMixin', 'GroupNorm', 'GroupProxyNorm',
           'IterNorm', 'StatNorm2d', 'Unitization2d', 'WSConv2d', 'mark_iteration', 'resolve_groups', 'set_fused',
           'set_update_rate', 'standardize_weight']
