"""Saving and loading fused models.

A fused model's modules differ from the config's (plain convs with biases, GroupNorms, ...), so its
state_dict does not load into the model the config builds. ``fuse`` decides the fused structure from
module types and geometry only (never from values), so ``load_fused`` rebuilds it exactly: build the
model from the config, ``fuse`` it, then load the saved state_dict strictly. The file holds only tensors
and plain Python values, so it loads with ``torch.load(weights_only=True)``.
"""
import copy
import importlib
from typing import Optional, Union

import torch
import torch.nn as nn

from .fuse import fuse

FORMAT = 'normdense-fused-v1'


def save_fused(model: nn.Module, path: str, meta: Optional[dict] = None) -> None:
    """Write the fused ``model``'s tensors to ``path`` with ``meta`` (plain values; ``tools/deploy.py`` records
    the norm the unfused model held, ``checkpoint.norm_of_keys``, for :func:`load_fused`'s check)."""
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


def switched_config(config, norm: Optional[str] = None, cfg_options: Optional[dict] = None):
    """(config, spec): ``config`` (a path, a packaged name such as ``mmseg::...``, or a Config: copied) after
    ``cfg_options``, with the norm switch in any of its forms applied to a plain ``cfg.model``: the runner form
    (``normdense_norm``, what ``tools/train.py --norm`` and ``--cfg-options normdense_norm=...`` record) and the
    model-type form (``type='NormSwitched'``) give the same switched config (same state-dict keys). ``norm``
    switches to that norm (as ``tools/train.py --norm``). ``spec``: the switch (``parse_spec``), or None."""
    from mmengine.config import Config

    from ..codebases import read_config
    from ..norm_switch import parse_spec, switch_norm
    cfg = copy.deepcopy(config) if isinstance(config, Config) else read_config(config)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    spec = cfg.get('normdense_norm')
    if cfg.model.get('type') == 'NormSwitched':
        wrapped = cfg.model
        cfg.model = copy.deepcopy(wrapped['model'])
        if wrapped.get('data_preprocessor') is not None:
            cfg.model.setdefault('data_preprocessor', wrapped['data_preprocessor'])
        spec = {k: wrapped[k] for k in ('norm', 'num_groups', 'channels_per_group', 'exclude', 'convert')
                if k in wrapped}
    if norm is not None:
        spec = dict(parse_spec(spec), norm=norm) if spec else norm
    if not spec:
        return cfg, None
    spec = parse_spec(spec)
    switch_norm(cfg, spec)
    return cfg, spec


def build_switched(cfg, spec: Optional[dict] = None) -> nn.Module:
    """The model of a :func:`switched_config`, its hard-coded layers converted where the switch says
    ``convert=True`` (as ``NormSwitchRunner`` does)."""
    model = build_model_from_config(cfg)
    if spec and spec['convert']:
        from ..norm_switch import SwitchReport, finish_model
        model = finish_model(model, spec, SwitchReport(spec['norm']))
    return model


def load_trained(model: nn.Module, checkpoint: str) -> None:
    """Load ``checkpoint`` (a trained checkpoint: a state dict or an mmengine Runner checkpoint) strictly; one
    line where it does not fit, naming both norms where it holds another norm than ``model``."""
    from mmengine.runner.checkpoint import load_state_dict

    from ..checkpoint import check_checkpoint_path, check_load, read_checkpoint, state_dict_of
    check_checkpoint_path(checkpoint)
    ckpt = read_checkpoint(checkpoint, logger='silent')
    check_load(model, ckpt, checkpoint, hint=None)
    load_state_dict(model, state_dict_of(ckpt), strict=True)


def load_fused(cfg, path: str, map_location: Union[str, torch.device] = 'cpu', norm: Optional[str] = None) -> nn.Module:
    """Rebuild the fused model of ``cfg`` (a config path, Config or dict, switched as :func:`switched_config`)
    and load a ``save_fused`` file strictly; a file of another norm is one line naming both. ``norm``: switch the
    config to that norm first (as ``tools/train.py --norm``)."""
    from ..checkpoint import CheckpointMismatchError, norm_of_keys, other_norm_line, read_checkpoint
    from ..errors import debug_requested
    ckpt = read_checkpoint(path, map_location=map_location)  # weights-only; one-line error if damaged
    if not isinstance(ckpt, dict) or ckpt.get('format') != FORMAT:
        raise ValueError(f'{path} is not a fused normdense checkpoint (written by tools/deploy.py)')
    if isinstance(cfg, dict) and not hasattr(cfg, 'filename'):
        from mmengine.config import Config
        cfg = Config(cfg)
    model = build_switched(*switched_config(cfg, norm)).eval()
    built, held = norm_of_keys(model.state_dict()), ckpt.get('meta', {}).get('norm')
    fuse(model)
    if held is not None and held != built:
        keys = ''
        if debug_requested():
            from ..checkpoint import describe_mismatch, load_mismatch
            keys = f' ({describe_mismatch(*load_mismatch(model, ckpt["state_dict"]))})'
        raise CheckpointMismatchError(f"fused checkpoint {path} {other_norm_line(held, built, f'norm={held!r}')}{keys}")
    model.load_state_dict(ckpt['state_dict'], strict=True)
    return model.eval()
