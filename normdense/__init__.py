"""normdense: micro-batch-friendly normalization layers for OpenMMLab detection and segmentation.

Importing the package checks that torch, mmengine and mmcv are in the supported ranges
(normdense/version.py), registers every layer, backbone and hook into mmengine's root registries (so
mmdet, mmseg and mmpretrain configs see them) and allow-lists the types mmengine's Runner checkpoints
need for torch.load(weights_only=True); every mmengine checkpoint scheme (local, https://, open-mmlab://,
torchvision://) then loads weights-only (``normdense.checkpoint.install_safe_loaders``, applied when
mmengine.runner.checkpoint is imported). mmdet, mmseg and mmpretrain are optional (normdense.codebases)
and not imported here: their models register when a config or tool needs them (normdense.lazy).
"""

from .version import __version__  # noqa: F401
# NORMDENSE_LAYERS_ONLY=1 (normdense/compat.py): torch alone is checked and nothing below is imported; what
# needs mmengine then fails on its own import
from .compat import LAYERS_ONLY, LAYERS_ONLY_ENV, check_core_versions  # noqa: F401
check_core_versions(names=('torch', ) if LAYERS_ONLY else None)

if not LAYERS_ONLY:
    from .checkpoint import allow_mmengine_checkpoint_types, install_safe_loaders_on_import
    from . import registry  # noqa: F401  (registers into mmengine's root MODELS / HOOKS)

    allow_mmengine_checkpoint_types()
    install_safe_loaders_on_import()  # patched when mmengine.runner.checkpoint is imported (it is slow to import)
    from .model_convert import convert_model, revert_model  # noqa: F401  (BN/GN/convs of a built model)
    from .norm_switch import CHOICES as NORM_CHOICES, switch_norm  # noqa: F401  (the norm switch on a config)
