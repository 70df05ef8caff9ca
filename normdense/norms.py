"""The norms normdense switches a model between, by the names the tools take (``--norm``, the norm switch), and the
state-dict entries that tell them apart in a checkpoint. Below both users (``norm_switch``, ``checkpoint``): a
module that imports nothing of normdense."""

# the norm switch's choices (``tools/train.py --norm``, ``normdense.norm_switch``)
CHOICES = ('bn', 'gn', 'gn-ws', 'bcn-ws', 'gn-pn', 'iternorm', 'unitization')

# the state-dict entries that tell the norms apart (module suffix -> the norm switch's name), strongest first
STATE_KEYS = (('proxy_beta', 'gn-pn'), ('proxy_gamma', 'gn-pn'), ('batch_weight', 'bcn'), ('running_wm', 'iternorm'),
              ('alpha', 'unitization'), ('running_input_mean', 'equinorm'), ('running_var', 'bn'))
