"""The norm switch on the installed codebases' own model zoo: can a packaged config take a norm?

:func:`try_norm` switches one mmdet / mmseg config to one norm (:func:`normdense.switch_norm`), builds the
model without pretrained weights and runs one training forward + backward of its feature extractor (and
decode head) on random images, checking that the loss and every gradient are finite. It returns a
:class:`ZooResult`: ``ok``, or one line saying why that architecture cannot take that norm, never a
traceback. :func:`representative_configs` picks one config per folder of a codebase's ``.mim/configs``.
``benchmarks/zoo_sweep.py`` runs the whole table; docs/any_model.md summarises it.
"""
import contextlib
import copy
import logging
import math
import os
import os.path as osp
import re
import signal
import time
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from .codebases import read_config
from .norm_switch import CHOICES, _registry, finish_model, switch_norm

# folders of .mim/configs that hold no model of their own (shared bases, dataset-only or deploy configs)
_SKIP_FOLDERS = ('_base_', 'common', 'legacy_1.x', 'misc', 'deploy')
_SITE_PACKAGES = re.compile(r'[^\s"\']*[/\\]site-packages[/\\]')
# names that usually mark the plain, smallest variant of a folder's configs
_PREFER = ('r18', 'r50', 'tiny', 'small', 's_', 'mobilenet', '-t_', 'b0')


@dataclass
class ZooResult:
    config: str
    norm: str
    status: str  # 'ok' or a short reason category
    detail: str = ''  # one line
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == 'ok'

    def line(self) -> str:
        text = self.status if not self.detail else f'{self.status}: {self.detail}'
        return text + (f" ({'; '.join(self.notes)})" if self.notes else '')


def package_configs(codebase: str) -> str:
    import importlib
    return osp.join(osp.dirname(importlib.import_module(codebase).__file__), '.mim', 'configs')


def _has_model(path: str) -> bool:
    with open(path, encoding='utf-8') as f:
        text = f.read()
    return bool(re.search(r'^model\s*=|_base_', text, re.M))


def _preference(name: str) -> Tuple:
    stem = name.lower()
    return (not any(p in stem for p in _PREFER), 'cityscapes' in stem, len(stem), stem)


def representative_configs(codebase: str, folders: Optional[List[str]] = None) -> List[Tuple[str, str]]:
    """``[(folder, config path)]``: one config per model folder of ``codebase``'s packaged configs, the one
    whose name marks the plainest small variant (R-18/R-50, tiny, ...), else the shortest name."""
    root = package_configs(codebase)
    out = []
    for folder in sorted(os.listdir(root)):
        path = osp.join(root, folder)
        if not osp.isdir(path) or folder in _SKIP_FOLDERS or (folders and folder not in folders):
            continue
        names = [n for n in os.listdir(path) if n.endswith('.py') and _has_model(osp.join(path, n))]
        if names:
            out.append((folder, osp.join(path, min(names, key=_preference))))
    return out


def _offline_cpu(node, mim_root=None):
    """The model dict as the sweep builds it, in place: every pretrained-weight load dropped (from scratch,
    offline), SyncBN as BN (one CPU process, as the codebases' own unit tests build their configs), and a
    distillation teacher's relative config path (``configs/gfl/...``, written for a source checkout) found in
    the package."""
    if isinstance(node, dict):
        if node.get('type') in ('SyncBN', 'MMSyncBN'):
            node['type'] = 'BN'
        init = node.get('init_cfg')
        if isinstance(init, dict) and (init.get('type') in ('Pretrained', 'PretrainedBackbone')
                                       or 'checkpoint' in init):
            node['init_cfg'] = None
        for key in ('pretrained', 'teacher_ckpt'):
            if isinstance(node.get(key), str):
                node[key] = None
        teacher = node.get('teacher_config')
        if isinstance(teacher, str) and mim_root and not osp.isfile(teacher):
            packaged = osp.join(mim_root, teacher)
            node['teacher_config'] = packaged if osp.isfile(packaged) else teacher
        for value in node.values():
            _offline_cpu(value, mim_root)
    elif isinstance(node, (list, tuple)):
        for value in node:
            _offline_cpu(value, mim_root)


@contextlib.contextmanager
def _quiet():
    """mmengine logs one INFO line per parameter in init_weights: keep the sweep's log readable."""
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def _tensors(out):
    if torch.is_tensor(out):
        yield out
    elif isinstance(out, (list, tuple)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


def _feature_model(model):
    """What extracts features: the model (detectors, segmentors), its ``detector`` (trackers), else None."""
    for candidate in (model, getattr(model, 'detector', None)):
        if candidate is not None and hasattr(candidate, 'extract_feat'):
            return candidate
    return None


def _forward(model, x):
    """The feature extractor (+ neck) of a detector, the decode heads of a segmentor, the head of a classifier."""
    feats = _feature_model(model).extract_feat(x)
    outs = [feats]
    if 'ImageClassifier' in {c.__name__ for c in type(model).__mro__} and getattr(model, 'head', None) is not None:
        outs.append(model.head(feats))  # its norm slots too (a BN1d in MobileNetV3's head: (N, C) input)
    head = getattr(model, 'decode_head', None)
    if head is not None:
        if isinstance(head, torch.nn.ModuleList):  # CascadeEncoderDecoder: each head refines the previous
            prev = head[0](feats)
            for h in head[1:]:
                prev = h(feats, prev)
            outs.append(prev)
        else:
            outs.append(head(feats))
    return outs


def _one_line(e: BaseException) -> str:
    text = ' '.join(str(e).split()) or type(e).__name__
    text = _SITE_PACKAGES.sub('', text)  # '<pkg>/...' rather than this machine's install path
    return f'{type(e).__name__}: {text[:300]}'


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def try_norm(config: str, norm: Optional[str], size: int = 64, batch: int = 2, seed: int = 0,
             timeout: int = 0) -> ZooResult:
    """Switch ``config`` (a path or ``mmdet::...`` name) to ``norm`` (``None``: as packaged, SyncBN as BN), build
    it without pretrained weights and run one training forward + backward at ``batch`` x 3 x ``size`` x ``size``.
    ``timeout`` (seconds, main thread only; 0: none) ends a case that takes longer with status ``'timeout'``."""
    if timeout:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(timeout)
    try:
        return _try_norm(config, norm, size, batch, seed)
    except _Timeout:
        return ZooResult(config, norm or 'as packaged', 'timeout', f'more than {timeout} s')
    finally:
        if timeout:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def _try_norm(config, norm, size, batch, seed) -> ZooResult:
    from mmengine.registry import DefaultScope

    from .jobs import codebase_of
    from .layers import set_update_rate
    start = time.perf_counter()
    result = ZooResult(config, norm or 'as packaged', 'ok')
    stage = 'config'
    try:
        cfg = read_config(config)
        if not isinstance(cfg.get('model'), dict):
            result.status, result.detail = 'no model', 'the config defines no model (a dataset or runtime config)'
            return result
        scope = codebase_of(cfg)
        model_cfg = copy.deepcopy(cfg.model)
        _offline_cpu(model_cfg, osp.dirname(package_configs(scope)) if scope != 'mmengine' else None)
        cfg.model = model_cfg
        report = None
        if norm is not None:
            stage = 'switch'
            report = switch_norm(cfg, norm)
            if not report.switched:
                result.status, result.detail = 'nothing to switch', 'no module of the model takes a norm_cfg'
                return result
        stage = 'build'
        with DefaultScope.overwrite_default_scope(scope), warnings.catch_warnings():
            warnings.simplefilter('ignore', UserWarning)  # the codebases' deprecation chatter, per build
            model = _registry(scope).build(cfg.model)
            if hasattr(model, 'init_weights'):
                with _quiet():
                    model.init_weights()  # as mmengine's Runner does (pretrained loads were dropped above)
            if norm is not None:
                model = finish_model(model, norm, report)
                left = [r for r in (report.conversion.left if report.conversion is not None else [])
                        if 'hard-coded' in r[3]]  # not the predictors, which stay plain by design
                if left:
                    result.notes.append(f'{len(left)} hard-coded layers the config does not reach, first {left[0][0]}')
                for policy, choices in report.groups.items():
                    picked = ', '.join(f'{c}->{g}' for (c, g) in sorted(choices))
                    result.notes.append(f'groups {picked}')
            if _feature_model(model) is None:
                result.status, result.detail = 'no feature extractor', f'{type(model).__name__} has no extract_feat'
                return result
            stage = 'train step'
            torch.manual_seed(seed)
            model.train()
            set_update_rate(model, 0.01)  # estimate-mode layers: r as EstimateRateHook would set it
            channels = (cfg.model.get('backbone') or {}).get('in_channels', 3)  # 6 for change detection (LEVIR)
            x = torch.randn(batch, channels if isinstance(channels, int) else 3, size, size)
            outs = list(_tensors(_forward(model, x)))
            loss = sum(o.float().pow(2).mean() for o in outs if o.is_floating_point())
            if not torch.is_tensor(loss) or not loss.requires_grad:
                result.status, result.detail = 'no trainable output', 'the forward gave no tensor with a gradient'
                return result
            loss.backward()
            if not math.isfinite(loss.item()):
                result.status, result.detail = 'non-finite', f'loss {loss.item()}'
                return result
            bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
            if bad:
                result.status, result.detail = 'non-finite', f'{len(bad)} gradients, first {bad[0]}'
    except _Timeout:
        raise
    except Exception as e:  # noqa: BLE001  (the sweep's row says what failed, in one line)
        result.status, result.detail = f'{stage} fails', _one_line(e)
    finally:
        result.seconds = time.perf_counter() - start
    return result


def sweep(configs: List[Tuple[str, str]], norms=CHOICES, size: int = 64, batch: int = 2, log=print,
          timeout: int = 300) -> dict:
    """``{folder: {'config': path, 'as packaged': line, norm: line}}`` over ``configs`` x ``norms``; the norms
    of an architecture that fails as packaged are not tried: they read ``fails as packaged too: <its line>``."""
    table = {}
    total, done = len(configs) * (len(norms) + 1), 0
    t0 = time.perf_counter()
    for folder, path in configs:
        row = dict(config=path.split('.mim' + os.sep + 'configs' + os.sep)[-1])
        base = try_norm(path, None, size, batch, timeout=timeout)
        row['as packaged'] = base.line()
        for norm in norms:
            row[norm] = (try_norm(path, norm, size, batch, timeout=timeout).line() if base.ok else
                         f'fails as packaged too: {base.line()}')
        table[folder] = row
        done += len(norms) + 1
        elapsed = time.perf_counter() - t0
        eta = elapsed / done * (total - done)
        ok = sum(v.startswith('ok') for k, v in row.items() if k in norms)
        log(f'[{done}/{total}] {folder}: {ok}/{len(norms)} ok ({elapsed:.0f} s, ETA {eta:.0f} s)')
    return table
