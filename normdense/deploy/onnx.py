"""ONNX export of a normdense model and its check in ONNX Runtime (``tools/deploy.py --onnx``).

In eval mode every normdense layer exports with both of torch's exporters: the TorchScript one
(``dynamo=False``, what mmdeploy drives) and ``dynamo=True``. While a graph is recorded, BCN, GN+PN and
Unitization run the modules of their inference form (``eval_form()``, ``layers/eval_form.py``) instead of the
training engine; WS, IterNorm, EquiNorm and GNAuto are standard ops already. A fused model (``fuse``) holds only
torch.nn modules. The codebases' models are wrapped by :func:`exportable` into a module of tensors in, tensors out.
docs/deploy.md.
"""
import contextlib
import importlib
import sys
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ExportError, SetupError
from .fuse import require_eval

DEPLOY_EXTRA = 'pip install "normdense[deploy]"'


def require(*modules: str, purpose: str = 'ONNX export') -> None:
    """Import ``modules`` or raise a one-line SetupError naming the extra that installs them."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise SetupError(f'{purpose} needs {name} ({e}): {DEPLOY_EXTRA} installs onnx, onnxruntime and '
                             f'onnxscript') from None


def celu_opset11(g, x, alpha):
    # CELU is an ONNX operator from opset 12; before it, celu(x, a) = a elu(x / a) (ELU: opset 6)
    from torch.onnx import symbolic_helper
    dtype = {'Double': torch.float64, 'Half': torch.float16, 'BFloat16': torch.bfloat16}.get(
        x.type().scalarType(), torch.float32)
    a = g.op('Constant', value_t=torch.tensor(symbolic_helper._maybe_get_const(alpha, 'f'), dtype=dtype))
    return g.op('Mul', g.op('Elu', g.op('Div', x, a), alpha_f=1.0), a)


@contextlib.contextmanager
def register_symbolics():
    """While active, the TorchScript exporter's translations that torch lacks for the layers' ops at mmdeploy's
    opset 11: ``aten::celu`` (GN+PN's CELU) before opset 12; :func:`export_onnx` runs inside it. Under mmdeploy
    the same symbolic is mmdeploy's registration (``normdense.deploy.mmdeploy``)."""
    torch.onnx.register_custom_op_symbolic('aten::celu', celu_opset11, 11)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic('aten::celu', 11)


def _flat(outputs) -> List[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in _flat(o)]
    raise ExportError(f'an exported output must be a tensor or a list/tuple of tensors, got {type(outputs).__name__}')


class SegmentorLogits(nn.Module):
    """An mmseg segmentor as image -> logits (N, classes, H, W) at the input's size (what its ``predict``
    resizes before the argmax)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        logits = self.model._forward(x)  # backbone, neck, decode head
        return F.interpolate(logits, size=x.shape[2:], mode='bilinear',
                             align_corners=self.model.decode_head.align_corners)

    def output_names(self, x) -> List[str]:
        return ['logits']


class DetectorRawOutputs(nn.Module):
    """An mmdet detector as image -> the tensors computed before any box decoding or NMS: the neck's feature
    maps, then the RPN's (two-stage) or the dense head's (single-stage) raw outputs per level. RoI heads need
    proposals (NMS): they are exported by mmdeploy, not here."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def _head(self):
        for name in ('rpn_head', 'bbox_head'):  # two-stage: the RPN; single-stage: the dense head
            if getattr(self.model, name, None) is not None:
                return name, getattr(self.model, name)
        return None, None

    def forward(self, x):
        feats = self.model.extract_feat(x)
        name, head = self._head()
        return tuple(_flat([feats] + ([] if head is None else [head(feats)])))

    def output_names(self, x) -> List[str]:
        """neck.{level}, then {head}.{output}.{level} (e.g. rpn_head.0.2: the RPN's class scores at level 2)."""
        with torch.no_grad():
            feats = self.model.extract_feat(x)
            name, head = self._head()
            outs = [] if head is None else head(feats)
        names = [f'neck.{i}' for i in range(len(feats))]
        for j, per_level in enumerate(outs):
            names += [f'{name}.{j}.{i}' for i in range(len(_flat(per_level)))]
        return names


class ClassifierLogits(nn.Module):
    """An mmpretrain classifier as image -> logits (its ``mode='tensor'`` forward)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, mode='tensor')

    def output_names(self, x) -> List[str]:
        return ['logits']


# (codebase, module of its base class, base class, wrapper, kind)
_KINDS = (('mmseg', 'mmseg.models.segmentors', 'BaseSegmentor', SegmentorLogits, 'segmentor'),
          ('mmdet', 'mmdet.models.detectors', 'BaseDetector', DetectorRawOutputs, 'detector'),
          ('mmpretrain', 'mmpretrain.models.classifiers', 'BaseClassifier', ClassifierLogits, 'classifier'))


def _base_class(codebase: str, module: str, name: str):
    """The codebase's base class, or None where the codebase was never imported (then no model is one of its
    own: importing it here would only cost seconds) or is not installed."""
    if codebase not in sys.modules:
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def exportable(model: nn.Module) -> Tuple[nn.Module, str]:
    """(module of tensors, kind): a segmentor's logits, a detector's raw outputs, a classifier's logits (by the
    codebases' base classes), or ``model`` itself ('module')."""
    for codebase, module, name, wrapper, kind in _KINDS:
        base = _base_class(codebase, module, name)
        if base is not None and isinstance(model, base):
            return wrapper(model).eval(), kind
    return model, 'module'


def export_onnx(module: nn.Module, inputs: Sequence[torch.Tensor], path: str, opset: Optional[int] = 17,
                dynamo: bool = False, output_names: Optional[List[str]] = None) -> List[str]:
    """Export eval-mode ``module`` on ``inputs`` to ``path`` with the TorchScript exporter at ``opset`` or, with
    ``dynamo``, torch.export and onnxscript (``opset`` None: the exporter's default); returns the output names
    (``output_names``, else the module's ``output_names(*inputs)``, else output / output{i}). The file is
    checked by ``onnx.checker``."""
    return _export(module, inputs, path, opset, dynamo, output_names)[0]


def _export(module, inputs, path, opset, dynamo, output_names=None):
    """:func:`export_onnx`, returning (output names, PyTorch's flat outputs on ``inputs``)."""
    require('onnx', *(('onnxscript', ) if dynamo else ()))
    import onnx
    require_eval(module, 'export')
    inputs = tuple(inputs)
    with torch.no_grad():
        outputs = _flat(module(*inputs))
        names = output_names or (module.output_names(*inputs) if hasattr(module, 'output_names') else None) or \
            ([f'output{i}' for i in range(len(outputs))] if len(outputs) > 1 else ['output'])
        if len(names) != len(outputs):
            raise ExportError(f'{len(names)} output names for {len(outputs)} outputs')
        input_names = [f'input{i}' for i in range(len(inputs))] if len(inputs) > 1 else ['input']
        if dynamo:
            kw = {} if opset is None else {'opset_version': opset}
            torch.onnx.export(module, inputs, path, dynamo=True, input_names=input_names, output_names=names,
                              external_data=False, verbose=False, **kw)
        else:
            with register_symbolics():
                torch.onnx.export(module, inputs, path, dynamo=False, opset_version=opset, input_names=input_names,
                                  output_names=names, do_constant_folding=True)
    onnx.checker.check_model(path)
    return names, outputs


def run_onnxruntime(path: str, inputs: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The outputs of ONNX Runtime (CPU) on ``inputs``, as tensors."""
    require('onnxruntime', purpose='the ONNX Runtime check')
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # no per-node warnings
    session = ort.InferenceSession(path, opts, providers=['CPUExecutionProvider'])
    feed = {i.name: t.detach().cpu().numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def relative_difference(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    """The largest, over outputs, of max |got - ref| / max |ref| (the scale of each output)."""
    if len(ref) != len(got):
        raise ExportError(f'ONNX Runtime returned {len(got)} outputs, PyTorch {len(ref)}')
    worst = 0.0
    for r, g in zip(ref, got):
        r = r.detach().cpu().double()
        g = g.double()
        if r.shape != g.shape:
            raise ExportError(f'ONNX Runtime output of shape {tuple(g.shape)}, PyTorch {tuple(r.shape)}')
        scale = r.abs().max().item() if r.numel() else 0.0
        diff = (g - r).abs().max().item() if r.numel() else 0.0
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def export_and_check(module: nn.Module, inputs: Sequence[torch.Tensor], path: str, opset: Optional[int] = 17,
                     dynamo: bool = False) -> Tuple[List[str], float]:
    """:func:`export_onnx`, then ONNX Runtime on the same inputs: (output names, relative difference from the
    PyTorch eval output)."""
    names, ref = _export(module, inputs, path, opset, dynamo)
    return names, relative_difference(ref, run_onnxruntime(path, inputs))


def sample_size(cfg, multiple: int = 32) -> Tuple[int, int]:
    """(H, W) of a sample input for ``cfg``: its ``crop_size``, else the test pipeline's last crop size or
    Resize scale (w, h), else 512 x 512; rounded up to ``multiple`` (the pad_size_divisor of FPN models)."""
    size = cfg.get('crop_size')
    pipeline = cfg.get('test_dataloader', {}).get('dataset', {}).get('pipeline', [])
    for t in pipeline if size is None else []:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get('crop_size'), int):
            size = (t['crop_size'], t['crop_size'])
        elif isinstance(t.get('crop_size'), (tuple, list)):
            size = tuple(t['crop_size'])
        elif t.get('type') == 'Resize' and isinstance(t.get('scale'), (tuple, list)):
            size = (t['scale'][1], t['scale'][0])
    h, w = size if size is not None else (512, 512)
    return -(-int(h) // multiple) * multiple, -(-int(w) // multiple) * multiple


def export_trained(model: nn.Module, path: str, size: Tuple[int, int], opset: Optional[int] = 17,
                   dynamo: bool = False, seed: int = 0) -> dict:
    """Export the eval-mode codebase model ``model`` (fused or not) through :func:`exportable` on one image of
    ``size`` (a seeded normal sample: what a data preprocessor's normalized image looks like), run ONNX
    Runtime on it; returns what was exported (kind, input shape, output names and shapes, difference)."""
    module, kind = exportable(model.eval())
    x = torch.randn((1, 3) + tuple(size), generator=torch.Generator().manual_seed(seed))
    names, ref = _export(module, (x, ), path, opset, dynamo)
    diff = relative_difference(ref, run_onnxruntime(path, (x, )))
    return dict(kind=kind, input=tuple(x.shape), outputs={n: tuple(t.shape) for n, t in zip(names, ref)},
                difference=diff)
