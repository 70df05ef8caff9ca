"""Inference-time folding of normdense layers: ``fuse(model)``; ``save_fused`` / ``load_fused`` for the
files ``tools/deploy.py`` writes."""
from .fuse import ChannelLinear, RhoScaledConv2d, UnitizationStage2, channel_map_of, fuse
from .io import build_model_from_config, load_fused, save_fused

__all__ = ['fuse', 'ChannelLinear', 'RhoScaledConv2d', 'UnitizationStage2', 'channel_map_of', 'save_fused',
           'load_fused', 'build_model_from_config']
