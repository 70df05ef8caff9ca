"""The layer classes and user-facing helpers (``from normdense.layers import BatchChannelNorm2d``); engine
internals stay in their modules. Registered in normdense/registry.py."""
from ._estimate import mark_iteration, set_update_rate
from ._utils import set_fused
from .bcn import BatchChannelNorm2d
from .equinorm import ChannelAffine, EquiConv2d
from .groups import GroupNorm, resolve_groups
from .iternorm import IterNorm
from .proxy_norm import GroupProxyNorm
from .unitization import Unitization2d
from .ws import WSConv2d, standardize_weight

__all__ = ['BatchChannelNorm2d', 'ChannelAffine', 'EquiConv2d', 'GroupNorm', 'GroupProxyNorm', 'IterNorm',
           'Unitization2d', 'WSConv2d', 'mark_iteration', 'resolve_groups', 'set_fused', 'set_update_rate',
           'standardize_weight']
