"""The norms normdense switches a model between, by the names the tools take (``--norm``, the norm switch), and the
state-dict entries that tell them apart in a checkpoint: made from the layers' declarations (``layers/declare.py``),
below both users (``norm_switch``, ``checkpoint``)."""
from .layers import declarations

# the norm switch's choices (``tools/train.py --norm``, ``normdense.norm_switch``): mmcv's BN, then the declared
SWITCHES = {s.name: s for d in declarations() for s in d.switches}
CHOICES = ('bn', ) + tuple(SWITCHES)

# the state-dict entries that tell the norms apart (module suffix -> the norm's name), the declared layers' first:
# BN's running_var is in several of them
STATE_KEYS = tuple((key, d.state_name) for d in declarations() for key in d.state_keys) + (('running_var', 'bn'), )
