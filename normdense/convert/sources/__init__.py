"""One module per source layout (``--from``); each converter takes ``(state_dict, meta, norm=...,
ws_formula=..., num_groups=...)`` and returns a :class:`~normdense.convert.spec.Conversion` not yet checked
against a target."""
import re

from ..resnet_keys import strip_prefix
from ..spec import SOURCES, ConversionError
from .authors import convert_authors
from .mmpretrain import convert_mmpretrain
from .torchvision import convert_torchvision

CONVERTERS = dict(mmpretrain=convert_mmpretrain, authors=convert_authors, torchvision=convert_torchvision)


def detect_source(sd) -> str:
    """Guess the layout of a state dict (``--from`` when not given)."""
    keys = list(sd)
    if any(k.startswith('backbone.') for k in keys):
        return 'mmpretrain'
    bare, _ = strip_prefix(sd, 'module.')
    if any(re.search(r'(^|\.)bn\d+\.(pbn|bn)\.', k) for k in bare):
        return 'authors'
    if 'conv1.weight' in bare and any(k.endswith('.running_var') for k in bare):
        return 'torchvision'  # BatchNorm ResNet (with or without a DataParallel prefix)
    if 'conv1.weight' in bare and 'bn1.weight' in bare:
        return 'authors'  # GN+WS release (GroupNorm under BN names, no statistics)
    raise ConversionError('cannot tell the checkpoint layout from its keys (first keys: '
                          f'{keys[:5]}); pass --from {{{",".join(SOURCES)}}}')
