"""Saving and loading fused models.

A fused model's modules differ from the config's (plain convs with biases, GroupNorms, ...), so its
state_dict does not load into the model the config builds. ``fuse`` decides the fused structure from
module types and geometry only (never from values), so ``load_fused`` rebuilds it exactly: build the
model from the config, ``fuse`` it, then load the saved state_dict strictly. The file holds only tensors
and plain Python values, so it loads with ``torch.load(weights_only=True)``.
"""
import importlib
from typing import Optional, Union

import torch
import torch.nn as nn

from .fuse import fuse

FORMAT = 'normdense-fused-v1'


def save_fused(model: nn.Module, path: str, meta: Optional[dict] = None) -> None:
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save(dict(format=FORMAT, state_dict=state, meta=dict(meta or {})), path)


def build_model_from_config(cfg) -> nn.Module:
    """The config's model, built through the registry of its codebase (``default_scope``)."""
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    if isinstance(cfg, str):
        cfg = Config.fromfile(cfg)
    elif isinstance(cfg, dict) and not isinstance(cfg, Config):
        cfg = Config(cfg)
    scope = cfg.get('default_scope') or 'mmengine'
    init_default_scope(scope)
    registry = importlib.import_module(f'{scope}.registry').MODELS if scope != 'mmengine' else None
    if registry is None:
        from mmengine.registry import MODELS as registry
    return registry.build(cfg.model)


def load_fused(cfg, path: str, map_location: Union[str, torch.device] = 'cpu') -> nn.Module:
    """Rebuild the fused model of ``cfg`` (a config path, Config or dict) and load a ``save_fused`` file."""
    from ..checkpoint import read_checkpoint
    ckpt = read_checkpoint(path, map_location=map_location)  # weights-only; one-line error if damaged
    if not isinstance(ckpt, dict) or ckpt.get('format') != FORMAT:
        raise ValueError(f'{path} is not a fused normdense checkpoint (written by tools/deploy.py)')
    model = build_model_from_config(cfg).eval()
    fuse(model)
    model.load_state_dict(ckpt['state_dict'], strict=True)
    return model.eval()
