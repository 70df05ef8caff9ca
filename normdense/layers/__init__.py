"""The layer classes and user-facing helpers (``from normdense.layers import BatchChannelNorm2d``); engine
internals stay in their modules. Each layer file declares its layer (``declare.py``): normdense/registry.py
registers them, and the norm switch, checkpoint detection and optimizer take their tables from the
declarations."""
# isort: skip_file  (the import order is the declarations' order: the norm switch's choices, checkpoint detection)
from ._estimate import mark_iteration, set_update_rate
from ._utils import set_fused
from .groups import GroupNorm, resolve_groups  # 'gn', 'gn-ws'
from .bcn import BatchChannelNorm2d  # 'bcn-ws'
from .proxy_norm import GroupProxyNorm  # 'gn-pn'
from .iternorm import IterNorm
from .unitization import Unitization2d
from .equinorm import ChannelAffine, EquiConv2d
from .ws import WSConv2d, standardize_weight
from .declare import declarations

__all__ = ['BatchChannelNorm2d', 'ChannelAffine', 'EquiConv2d', 'GroupNorm', 'GroupProxyNorm', 'IterNorm',
           'Unitization2d', 'WSConv2d', 'declarations', 'mark_iteration', 'resolve_groups', 'set_fused',
           'set_update_rate', 'standardize_weight']
