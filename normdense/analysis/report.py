"""Offline normalization diagnostics of a trained model (the logic behind ``tools/analyze_norms.py``).

``analyze_checkpoint`` loads an OpenMMLab config and checkpoint, runs a few batches of one of the config's
dataloaders through the model in eval mode with ``LayerRecorder``s attached to the chosen layers, and
returns ``{layer: {diagnostic: value}}``. With a second checkpoint (e.g. an earlier iteration of the same
run) the layers' outputs under both are compared on the *same* batches for the ICS measures
(Unitization paper Eq. 2-3, 6-7: p_l^(t) vs p_l^(t + dt)). ``write_report`` stores the JSON and a PNG.
"""
import copy
import json
import math
import os.path as osp
from typing import Dict, List, Optional, Sequence

import torch

from .recorder import (DIAGNOSTICS, REFERENCE_DIAGNOSTICS, LayerRecorder, check_diagnostics, check_em_method,
                       check_ics_orders, check_snd_cfg, select_modules)

SPLITS = ('val', 'test', 'train')


def build_model_from_config(cfg, checkpoint: Optional[str] = None, device: str = 'cpu'):
    """Build ``cfg.model`` through the registry of ``cfg.default_scope`` (mmdet, mmseg, ...) and load
    ``checkpoint`` into it (mmengine ``load_checkpoint``)."""
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner import load_checkpoint

    init_default_scope(cfg.get('default_scope', None) or 'mmengine')
    # init_weights() is never called: the checkpoint provides the weights (no pretrained download)
    model = MODELS.build(copy.deepcopy(cfg.model))
    if checkpoint is not None:
        load_checkpoint(model, checkpoint, map_location='cpu', revise_keys=[(r'^module\.', '')])
    return model.to(device).eval()


def build_loader_from_config(cfg, split: str = 'val', num_workers: int = 0):
    from mmengine.runner import Runner

    if split not in SPLITS:
        raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
    key = f'{split}_dataloader'
    if cfg.get(key) is None:
        raise ValueError(f'the config has no {key}; choose another --split')
    loader_cfg = copy.deepcopy(cfg[key])
    loader_cfg['num_workers'] = num_workers
    loader_cfg['persistent_workers'] = loader_cfg.get('persistent_workers', False) and num_workers > 0
    return Runner.build_dataloader(loader_cfg, seed=0)


def _run(model, batches, recorders: List[LayerRecorder]):
    for r in recorders:
        r.reset()
        r.attach()
    try:
        with torch.no_grad():
            for data in batches:
                model.test_step(data)
    finally:
        for r in recorders:
            r.detach()


def analyze_model(model, batches: Sequence, layer_names=None, layer_types=None,
                  diagnostics: Sequence[str] = DIAGNOSTICS, reference_model=None, max_samples: int = 4096,
                  statdiff_groups: Optional[int] = None, snd_cfg: Optional[dict] = None,
                  ics_orders: Sequence[int] = (2, 3, 4), em_method: str = 'marginal',
                  seed: int = 0) -> Dict[str, Dict[str, float]]:
    """Diagnostics per layer of ``model`` (an mmengine ``BaseModel``: ``test_step(data)``) over ``batches``.

    ``ics_moment`` / ``em_distance`` need ``reference_model`` (same architecture, other weights); without
    it they are left out.
    """
    diagnostics = check_diagnostics(diagnostics)
    snd_cfg = check_snd_cfg(snd_cfg)
    ics_orders = check_ics_orders(ics_orders)
    check_em_method(em_method)
    if not isinstance(max_samples, int) or max_samples < 2:
        raise ValueError(f'max_samples must be an int >= 2, got {max_samples!r}')
    gen = torch.Generator().manual_seed(seed)
    layers = select_modules(model, layer_names, layer_types)
    if not layers:
        raise ValueError(f'no layer matches layer_names={layer_names} and layer_types={layer_types}')
    recorders = [LayerRecorder(n, m, diagnostics, max_samples, statdiff_groups, gen) for n, m in layers]
    references = {}
    if reference_model is not None and any(d in diagnostics for d in REFERENCE_DIAGNOSTICS):
        ref_modules = dict(reference_model.named_modules())
        missing = [n for n, _ in layers if n not in ref_modules]
        if missing:
            raise ValueError(f'the reference model lacks layers {missing}')
        ref_recorders = [LayerRecorder(n, ref_modules[n], REFERENCE_DIAGNOSTICS, max_samples, None, gen)
                         for n, _ in layers]
        _run(reference_model, batches, ref_recorders)
        references = {r.name: r.output_samples() for r in ref_recorders}
    _run(model, batches, recorders)
    return {r.name: r.compute(references.get(r.name), snd_cfg, ics_orders, em_method) for r in recorders}


def analyze_checkpoint(config: str, checkpoint: str, compare_checkpoint: Optional[str] = None,
                       split: str = 'val', num_batches: int = 4, cfg_options: Optional[dict] = None,
                       device: str = 'cpu', **analyze_kwargs) -> dict:
    """Load config + checkpoint(s), run ``num_batches`` batches of the ``split`` dataloader and return
    ``{'meta': {...}, 'layers': {layer: {diagnostic: value}}}`` (NaN where a value is undefined, written
    as null by ``write_report``)."""
    from ..codebases import read_config

    if not isinstance(num_batches, int) or num_batches < 1:
        raise ValueError(f'num_batches must be a positive int, got {num_batches!r}')
    cfg = read_config(config)  # a file or an mmdet::/mmseg:: name
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    model = build_model_from_config(cfg, checkpoint, device)
    reference = build_model_from_config(cfg, compare_checkpoint, device) if compare_checkpoint else None
    batches = []
    for data in build_loader_from_config(cfg, split):
        batches.append(data)
        if len(batches) == num_batches:
            break
    if not batches:
        raise ValueError(f'the {split} dataloader produced no batch')
    layers = analyze_model(model, batches, reference_model=reference, **analyze_kwargs)
    meta = dict(config=config, checkpoint=checkpoint, compare_checkpoint=compare_checkpoint, split=split,
                num_batches=len(batches),
                layer_types={n: type(m).__name__ for n, m in model.named_modules() if n in layers})
    return dict(meta=meta, layers=layers)


def _panels(layers: Dict[str, Dict[str, float]]):
    keys = sorted({k for v in layers.values() for k in v})
    panels = []
    frac_keys = [k for k in keys if k.startswith('power_') and k.endswith('_frac')]
    if frac_keys:
        panels.append(('power decomposition (PN Eq. 5, share)', frac_keys))
    for k in keys:
        if k not in frac_keys:
            panels.append((k, [k]))
    return panels


_TITLES = {
    'statdiff': 'StatDiff (WS/BCN Eq. 35)', 'snd': 'SND (IterNorm Eq. 10)', 'em_distance': 'EM distance (est.)',
    'power': 'power P (PN Eq. 5)', 'power_channel_imbalance': 'channel imbalance (CV of P_c)',
}


def plot_report(report: dict, path: str, title: Optional[str] = None) -> None:
    """One panel per diagnostic, one bar per layer (the power shares stacked)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    layers = report['layers']
    names = list(layers)
    panels = _panels(layers)
    if not panels:
        raise ValueError('nothing to plot: no diagnostic produced a value')
    width = max(6.0, 0.35 * len(names) + 2)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 1.6 * len(panels) + 1.4), sharex=True,
                             squeeze=False)
    xs = range(len(names))
    for ax, (panel, keys) in zip(axes[:, 0], panels):
        if len(keys) > 1:
            bottom = [0.0] * len(names)
            for k in keys:
                vals = [layers[n].get(k, math.nan) for n in names]
                ax.bar(xs, vals, bottom=bottom, label=k[len('power_'):-len('_frac')])
                bottom = [b + (0.0 if math.isnan(v) else v) for b, v in zip(bottom, vals)]
            ax.set_ylim(0, 1)
            ax.legend(fontsize=6, ncol=4, loc='upper right')
        else:
            vals = [layers[n].get(keys[0], math.nan) for n in names]
            ax.bar(xs, vals, color='tab:blue')
            finite = [v for v in vals if not math.isnan(v)]
            if finite and all(v == 0 for v in finite):
                ax.text(0.5, 0.5, '0 for every layer', transform=ax.transAxes, ha='center', va='center',
                        fontsize=8, color='gray')
                ax.set_ylim(0, 1)
        name = panel if len(keys) > 1 else _TITLES.get(panel, panel.replace('ics_moment_n', 'ICS bound (Eq. 6-7) n='))
        ax.set_title(name, fontsize=8)
        ax.tick_params(labelsize=6)
    axes[-1, 0].set_xticks(list(xs))
    axes[-1, 0].set_xticklabels(names, rotation=60, ha='right', fontsize=6)
    if title:
        fig.suptitle(title, fontsize=9)
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _nan_to_none(obj):
    """Strict JSON: undefined values (e.g. power shares of an all-zero output) become null."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_nan_to_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_report(report: dict, out_dir: str, stem: str = 'norm_diagnostics') -> Dict[str, str]:
    """Write ``<stem>.json`` and ``<stem>.png`` into ``out_dir``; returns their paths."""
    import mmengine

    mmengine.mkdir_or_exist(out_dir)
    json_path, png_path = osp.join(out_dir, f'{stem}.json'), osp.join(out_dir, f'{stem}.png')
    with open(json_path, 'w') as f:
        json.dump(_nan_to_none(report), f, indent=2, allow_nan=False)
    meta = report.get('meta', {})
    title = osp.basename(meta.get('checkpoint') or '')
    if meta.get('compare_checkpoint'):
        title += f"  (ICS / EM vs {osp.basename(meta['compare_checkpoint'])})"
    plot_report(report, png_path, title=title)
    return dict(json=json_path, png=png_path)
