"""Small mmdet Mask R-CNN / mmseg DeepLabV3 models built from the codebases' own base configs, and one
real training step (``model.train_step`` with an SGD OptimWrapper) on small random images.

Used by the layer tests: ``det_train_step(mask_rcnn_cfg(conv_cfg=..., norm_cfg=...))``.
"""
import copy
import os.path as osp

import torch
from mmengine.config import Config
from mmengine.optim import OptimWrapper
from mmengine.registry import init_default_scope
from mmengine.structures import PixelData

from normdense.layers import set_update_rate


def base_config(scope: str, rel_path: str) -> Config:
    """A config shipped inside an installed codebase (what ``_base_ = 'mmdet::...'`` reads)."""
    package = __import__(scope)
    return Config.fromfile(osp.join(osp.dirname(package.__file__), '.mim', 'configs', rel_path))


def _merge(cfg: dict, overrides: dict) -> dict:
    merged = Config(dict(model=cfg))
    merged.merge_from_dict({f'model.{k}': v for k, v in (overrides or {}).items()})
    return merged.model  # a ConfigDict, as the detectors expect (train_cfg.rpn attribute access)


def mask_rcnn_cfg(conv_cfg=None, norm_cfg=None, backbone=None, num_classes=3, width=64, overrides=None) -> dict:
    """mmdet's Mask R-CNN R-50-FPN base config shrunk to ResNet-18 with ``width``-channel FPN/heads,
    conv_cfg/norm_cfg on backbone, FPN, Shared4Conv1FCBBoxHead and mask head (the WS/BCN paper's
    placement). ``backbone`` replaces the backbone dict; ``overrides`` are dotted keys under ``model``
    (e.g. ``{'neck.act_cfg': None}``)."""
    model = copy.deepcopy(base_config('mmdet', '_base_/models/mask-rcnn_r50_fpn.py').model.to_dict())
    layer_cfgs = dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg)
    model['backbone'] = backbone or dict(type='ResNet', depth=18, num_stages=4, out_indices=(0, 1, 2, 3),
                                         frozen_stages=-1, norm_eval=False, style='pytorch', **layer_cfgs)
    model['neck'].update(in_channels=[64, 128, 256, 512], out_channels=width, **layer_cfgs)
    model['rpn_head'].update(in_channels=width, feat_channels=width)
    roi = model['roi_head']
    roi['bbox_roi_extractor']['out_channels'] = width
    roi['mask_roi_extractor']['out_channels'] = width
    roi['bbox_head'] = dict(roi['bbox_head'], type='Shared4Conv1FCBBoxHead', in_channels=width,
                            conv_out_channels=width, fc_out_channels=2 * width, num_classes=num_classes,
                            **layer_cfgs)
    roi['mask_head'].update(in_channels=width, conv_out_channels=width, num_classes=num_classes, **layer_cfgs)
    # few proposals keep a CPU step fast
    model['train_cfg']['rpn_proposal'].update(nms_pre=200, max_per_img=64)
    model['train_cfg']['rcnn']['sampler']['num'] = 32
    return _merge(model, overrides)


def deeplabv3_cfg(conv_cfg=None, norm_cfg=None, backbone=None, num_classes=4, overrides=None) -> dict:
    """mmseg's DeepLabV3 base config shrunk to ResNetV1c-18 (output stride 8), norm/conv cfgs in the
    backbone, ASPP head (image-pool branch included) and auxiliary FCN head."""
    model = copy.deepcopy(base_config('mmseg', '_base_/models/deeplabv3_r50-d8.py').model.to_dict())
    model.pop('pretrained', None)
    model['data_preprocessor']['size_divisor'] = 8  # the dataset configs usually set size=crop_size
    model['backbone'] = backbone or dict(model['backbone'], depth=18, conv_cfg=conv_cfg, norm_cfg=norm_cfg)
    model['decode_head'].update(in_channels=512, channels=64, num_classes=num_classes, conv_cfg=conv_cfg,
                                norm_cfg=norm_cfg)
    model['auxiliary_head'].update(in_channels=256, channels=32, num_classes=num_classes, conv_cfg=conv_cfg,
                                   norm_cfg=norm_cfg)
    return _merge(model, overrides)


def _sgd_step(model, data, lr):
    optim = OptimWrapper(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    set_update_rate(model, lr)  # what BCNRateHook does inside a Runner
    model.train()
    log_vars = model.train_step(data, optim)
    losses = {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in log_vars.items()}
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    return losses


def build_detector(model_cfg):
    init_default_scope('mmdet')
    from mmdet.registry import MODELS
    model = MODELS.build(copy.deepcopy(model_cfg))
    model.init_weights()
    return model


def det_train_step(model_cfg, image_size=(96, 128), batch_size=1, num_classes=3, lr=0.01, seed=0):
    """Build the detector and run one training step; returns the model and its loss values."""
    from mmdet.testing import demo_mm_inputs
    torch.manual_seed(seed)
    model = build_detector(model_cfg)
    data = demo_mm_inputs(batch_size, image_shapes=[(3, *image_size)] * batch_size, num_items=[3] * batch_size,
                          num_classes=num_classes, with_mask=True)
    return model, _sgd_step(model, data, lr)


def build_segmentor(model_cfg):
    init_default_scope('mmseg')
    from mmseg.registry import MODELS
    model = MODELS.build(copy.deepcopy(model_cfg))
    model.init_weights()
    return model


def seg_train_step(model_cfg, image_size=(64, 64), batch_size=1, num_classes=4, lr=0.01, seed=0):
    """Build the segmentor and run one training step on random images/label maps."""
    from mmseg.structures import SegDataSample
    torch.manual_seed(seed)
    model = build_segmentor(model_cfg)
    h, w = image_size
    samples = []
    for _ in range(batch_size):
        sample = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w)))
        sample.gt_sem_seg = PixelData(data=torch.randint(0, num_classes, (1, h, w)))
        samples.append(sample)
    data = dict(inputs=[torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for _ in range(batch_size)],
                data_samples=samples)
    return model, _sgd_step(model, data, lr)
