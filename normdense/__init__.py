"""normdense: micro-batch-friendly normalization layers for OpenMMLab detection and segmentation.

Importing the package registers every layer, backbone and hook into mmengine's root registries (so
mmdet, mmseg and mmpretrain configs see them) and allow-lists the types mmengine's Runner checkpoints
need for torch.load(weights_only=True).
"""
from .version import __version__  # noqa: F401
from .checkpoint import allow_mmengine_checkpoint_types
from . import registry  # noqa: F401  (registers into mmengine's root MODELS / HOOKS)

allow_mmengine_checkpoint_types()
