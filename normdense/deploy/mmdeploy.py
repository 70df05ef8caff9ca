"""mmdeploy's ``torch2onnx`` on normdense models under torch >= 2.9 (``tools/mmdeploy_torch2onnx.py``).

mmdeploy 1.3.1 (its last release, 2023) was written for torch's TorchScript ONNX exporter: it calls
``torch.onnx.export(...)`` without ``dynamo=``, and its rewriters act on that exporter only (symbolic functions
registered for aten ops, ``symbolic`` of mmcv's RoIAlign and of its NMS Function, a rewrite of the exporter's
``_model_to_graph``). Two later changes of torch break it, neither ours (``configs/deploy/README.md``):

* since torch 2.9 ``torch.onnx.export`` defaults to ``dynamo=True``. mmdeploy's call then goes through
  torch.export and onnxscript: a segmentor comes out at opset 18 instead of the requested 11, with its weights
  in a separate ``.onnx.data`` file, over 20x slower (the demo DeepLabV3 on 2 CPU cores: 65 s with BN and
  230 s with BCN+WS, against 3 s and 9 s with the TorchScript exporter); a two-stage detector stops in
  torch.export at mmdeploy's ``torch._shape_as_tensor`` (``RuntimeError: The tensor has a non-zero number of
  elements, but its data is not allocated yet``).
* the TorchScript exporter's ``_cast_<Type>`` symbolics were removed (pytorch/pytorch#164641, October 2025;
  torch 2.12.1 has no ``torch.onnx.symbolic_opset9._cast_Long``), which mmdeploy's RoIAlign symbolic (every RoI
  head: Mask R-CNN, Faster R-CNN, Cascade) imports while exporting: ``ImportError: cannot import name
  '_cast_Long' from 'torch.onnx.symbolic_opset9'``.

:func:`mmdeploy_compat` undoes both while it is active; outside it, torch is as it was. Nothing of mmdeploy's
is patched (its rewriters' ``inspect.stack()`` lookups make a Mask R-CNN export about 1.5x slower than a
``sys._getframe`` patch did: left as mmdeploy has it). What
normdense adds to the export itself goes through mmdeploy's own registries, active only inside its
``RewriterContext`` (:func:`register_rewriters`): GN+PN's CELU at opset 11 (``SYMBOLIC_REWRITER``). It patches module
attributes, so it reaches mmdeploy only in this process: mmdeploy's own ``tools/deploy.py`` runs ``torch2onnx``
in a spawned process, where the patch is absent; :func:`export` calls ``torch2onnx`` here instead (for ONNX
Runtime, ``tools/deploy.py`` adds no conversion step after it).
"""
import contextlib
import copy
import functools
import inspect
import os.path as osp
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..errors import ExportError, SetupError

MMDEPLOY_INSTALL = ('pip install --no-deps "mmdeploy==1.3.1" && pip install aenum multiprocess prettytable '
                    'terminaltables six (--no-deps: mmdeploy declares protobuf<=3.20.2, which onnx 1.23 and '
                    'onnxruntime 1.32 exclude, and grpcio, used by its SNPE backend only)')


def require_mmdeploy() -> None:
    """Import mmdeploy (and onnx, onnxruntime) or raise a one-line SetupError naming the install."""
    try:
        import mmdeploy  # noqa: F401
    except ImportError as e:
        raise SetupError(f'the mmdeploy route needs mmdeploy ({e}): {MMDEPLOY_INSTALL}') from None
    from .onnx import require
    require('onnx', 'onnxruntime', purpose='the mmdeploy route')


_REGISTERED = []


def register_rewriters() -> None:
    """normdense's additions to mmdeploy's export, in mmdeploy's registries (active only inside its
    ``RewriterContext``, as its own ``mmdeploy/pytorch/symbolics``): ``aten::celu`` at the context's opset (ONNX
    has CELU from opset 12 only; GN+PN with CELU). Idempotent."""
    if _REGISTERED:
        return
    from mmdeploy.core import SYMBOLIC_REWRITER

    from .onnx import celu_opset11
    SYMBOLIC_REWRITER.register_symbolic('celu', is_pytorch=True)(celu_opset11)
    _REGISTERED.append('celu')


def _cast_long(g, input, non_blocking=False):
    # what the removed symbolic_opset9._cast_Long emitted
    return g.op('Cast', input, to_i=torch.onnx.TensorProtoDataType.INT64)


@contextlib.contextmanager
def mmdeploy_compat():
    """While active, mmdeploy 1.3.1's export runs as on the torch it was written for: ``torch.onnx.export``
    without ``dynamo=`` is the TorchScript exporter (torch >= 2.9 defaults to dynamo), and
    ``torch.onnx.symbolic_opset9._cast_Long`` exists (newer torch dropped it; mmdeploy's RoIAlign symbolic
    imports it). Each is applied only where needed and undone on exit; neither has a registry of mmdeploy to go
    through: mmdeploy calls ``torch.onnx.export`` itself, and its RoIAlign symbolic imports ``_cast_Long`` from
    torch. Nothing of mmdeploy's own is patched: normdense's additions are registrations
    (:func:`register_rewriters`). Not thread-safe: it swaps two attributes of torch."""
    import torch.onnx.symbolic_opset9 as opset9

    register_rewriters()
    original = torch.onnx.export
    # version patch: torch >= 2.9 defaults to dynamo=True, and mmdeploy 1.3.1's call names no exporter
    param = inspect.signature(original).parameters.get('dynamo')
    if param is not None and param.default is True:
        @functools.wraps(original)
        def torchscript_export(*args, **kwargs):
            kwargs.setdefault('dynamo', False)
            return original(*args, **kwargs)

        torch.onnx.export = torchscript_export
    # version patch: torch dropped _cast_Long (pytorch#164641); mmdeploy 1.3.1's RoIAlign symbolic imports it
    added = not hasattr(opset9, '_cast_Long')
    if added:
        opset9._cast_Long = _cast_long
    try:
        yield
    finally:
        torch.onnx.export = original
        if added:
            del opset9._cast_Long


def model_config(config, norm: Optional[str] = None, cfg_options: Optional[dict] = None):
    """The model config as mmdeploy must see it: a plain ``cfg.model`` with the normdense layers in it
    (:func:`normdense.deploy.io.switched_config`: mmdeploy builds ``cfg.model`` itself, so the norm switch's
    other forms do not reach it). ``norm`` switches to another norm (as ``tools/test.py --norm``).
    ``config``: a path, a packaged name or a Config (copied)."""
    from .io import switched_config
    cfg, spec = switched_config(config, norm, cfg_options)
    if spec and spec['convert']:
        raise ExportError('a norm switch with convert=True converts layers after the model is built, which '
                          "mmdeploy's own model build does not do: export with tools/deploy.py --onnx")
    return cfg


def _check_checkpoint(cfg, checkpoint: str) -> None:
    # mmdeploy loads with strict=False: a checkpoint of another norm would export a partly random model
    from ..checkpoint import (CheckpointMismatchError, check_checkpoint_path, describe_mismatch, load_mismatch,
                              norm_mismatch, read_checkpoint, state_dict_of)
    from ..errors import debug_requested
    from .io import build_model_from_config
    check_checkpoint_path(checkpoint)
    model, state_dict = build_model_from_config(cfg), state_dict_of(read_checkpoint(checkpoint, logger='silent'))
    mismatch = load_mismatch(model, state_dict)
    if any(mismatch):
        other_norm = norm_mismatch(model.state_dict().keys(), state_dict.keys())
        if other_norm:
            keys = f' ({describe_mismatch(*mismatch)})' if debug_requested() else ''
            raise CheckpointMismatchError(f'checkpoint {checkpoint} does not match the model config: it {other_norm}'
                                          f'{keys}')
        raise CheckpointMismatchError(
            f'checkpoint {checkpoint} does not match the model config: {describe_mismatch(*mismatch)}. mmdeploy '
            'loads non-strictly and would export a partly random model: give the config it was trained with '
            '(or --norm NAME)')


def input_shape(deploy_cfg, model_cfg) -> Tuple[int, int]:
    """(H, W) of the exported input: the deploy config's ``onnx_config.input_shape`` (mmdeploy's (W, H)), else
    the model config's crop size / test resize rounded up to 32 (:func:`normdense.deploy.onnx.sample_size`)."""
    from .onnx import sample_size
    shape = deploy_cfg.get('onnx_config', {}).get('input_shape')
    if shape:
        return int(shape[1]), int(shape[0])
    return sample_size(model_cfg)


def sample_image(shape: Tuple[int, int], seed: int = 0) -> np.ndarray:
    """A seeded random uint8 BGR image (H, W, 3): what to trace on when no image is given."""
    return np.random.RandomState(seed).randint(0, 256, tuple(shape) + (3, ), dtype=np.uint8)


def deploy_config(deploy_cfg):
    """A deploy config (a path, a name under normdense's configs such as ``deploy/...``, or a Config: copied)."""
    from mmengine.config import Config
    if isinstance(deploy_cfg, Config):
        return copy.deepcopy(deploy_cfg)
    from ..tools import resolve_config
    return Config.fromfile(resolve_config(deploy_cfg) or deploy_cfg)


def export(deploy_cfg, model_cfg, checkpoint: Optional[str], work_dir: str,
           img: Union[str, np.ndarray, None] = None, device: str = 'cpu', strict: bool = True) -> str:
    """mmdeploy's ``torch2onnx`` inside :func:`mmdeploy_compat`: the model of ``model_cfg`` (after
    :func:`model_config`) with ``checkpoint`` (strictly checked first; None: initial weights) traced on ``img``
    (default :func:`sample_image` at :func:`input_shape`), written to ``work_dir``/``onnx_config.save_file``
    and checked by ``onnx.checker``. Returns the .onnx path."""
    require_mmdeploy()
    import onnx
    from mmdeploy.apis import torch2onnx
    deploy_cfg = deploy_config(deploy_cfg)
    model_cfg = model_config(model_cfg)
    if checkpoint is not None and strict:
        _check_checkpoint(model_cfg, checkpoint)
    if img is None:
        img = sample_image(input_shape(deploy_cfg, model_cfg))
    save_file = deploy_cfg.get('onnx_config', {}).get('save_file', 'end2end.onnx')
    with mmdeploy_compat():
        torch2onnx(img, work_dir, save_file, deploy_cfg, model_cfg, checkpoint, device=device)
    path = osp.join(work_dir, save_file)
    onnx.checker.check_model(path)
    return path


def pytorch_and_onnxruntime(deploy_cfg, model_cfg, checkpoint: Optional[str], onnx_path: str,
                            img: Union[str, np.ndarray, None] = None,
                            device: str = 'cpu') -> Tuple[List[str], List[torch.Tensor], List[torch.Tensor]]:
    """(output names, PyTorch outputs, ONNX Runtime outputs) on ``img`` prepared by mmdeploy's task processor:
    PyTorch runs mmdeploy's rewritten forward (what the graph records: its post-processing, ``with_argmax``)
    with the layers' own eval path; ONNX Runtime (CPU) runs ``onnx_path``."""
    require_mmdeploy()
    from mmdeploy.apis import build_task_processor
    from mmdeploy.core import RewriterContext, patch_model
    from mmdeploy.utils import IR, get_backend

    from .onnx import _flat, run_onnxruntime
    deploy_cfg = deploy_config(deploy_cfg)
    model_cfg = model_config(model_cfg)
    shape = input_shape(deploy_cfg, model_cfg)
    if img is None:
        img = sample_image(shape)
    processor = build_task_processor(model_cfg, deploy_cfg, device)
    model = processor.build_pytorch_model(checkpoint)
    data, inputs = processor.create_input(img, deploy_cfg.onnx_config.get('input_shape'),
                                          data_preprocessor=getattr(model, 'data_preprocessor', None))
    backend = get_backend(deploy_cfg).value
    opset = deploy_cfg.onnx_config.get('opset_version', 11)
    patched = patch_model(model, cfg=deploy_cfg, backend=backend, ir=IR.ONNX)
    with mmdeploy_compat(), RewriterContext(cfg=deploy_cfg, backend=backend, opset=opset), torch.no_grad():
        ref = _flat(patched.forward(inputs, data['data_samples'], mode='predict'))
    got = run_onnxruntime(onnx_path, [inputs])
    return list(deploy_cfg.onnx_config.output_names), [r.cpu() for r in ref], got


def match_detections(ref: Sequence[torch.Tensor], got: Sequence[torch.Tensor], top: int = 20,
                     min_size: float = 4.0, box_tol: float = 1e-2, score_tol: float = 1e-4,
                     mask_tol: float = 1e-3) -> Dict[str, int]:
    """How many of the ``top`` highest-scoring PyTorch detections of image 0 with both sides >= ``min_size``
    pixels ONNX Runtime also returns: same label, box corners within ``box_tol`` pixels, score within
    ``score_tol``, mask probabilities (if any) within ``mask_tol``. ``ref``/``got``: (dets (N, K, 5), labels
    (N, K)[, masks (N, K, h, w)]), PyTorch's and ONNX Runtime's.

    Matched as sets, not row by row: mmdeploy's ONNX RoiAlign at opset < 16 (no ``aligned``; RoIs at least one
    feature pixel wide) differs from mmcv's for RoIs thinner than a feature pixel, so such proposals give
    other boxes in ONNX Runtime and shift the rows after them; a model with random weights proposes many."""
    rd, rl = ref[0][0], ref[1][0]
    gd, gl = got[0][0], got[1][0]
    masks = len(ref) > 2 and len(got) > 2
    sized = ((rd[:, 2] - rd[:, 0]) >= min_size) & ((rd[:, 3] - rd[:, 1]) >= min_size)
    rows = torch.nonzero(sized).flatten()[:top].tolist()
    matched = 0
    for i in rows:
        close = ((gd[:, :4] - rd[i, :4]).abs().amax(1) <= box_tol) & ((gd[:, 4] - rd[i, 4]).abs() <= score_tol) & \
            (gl == rl[i])
        if masks:
            close &= (got[2][0] - ref[2][0][i]).flatten(1).abs().amax(1) <= mask_tol
        matched += int(bool(close.any()))
    return dict(compared=len(rows), matched=matched)
