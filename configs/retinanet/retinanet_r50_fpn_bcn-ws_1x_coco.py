# RetinaNet R-50-FPN, BCN+WS.
# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): estimate-mode BCN, r = lr (EstimateRateHook
# from ../_base_/norms/bcn-ws.py).
# Layers in the backbone, FPN and the 4+4 head convs shared over the FPN levels (estimate-mode BCN moves its
# estimates once per iteration over all levels' calls); the cls/reg predictors stay plain convs.
# A diff over mmdet's config; the same model as `normdense_norm = 'bcn-ws'` (docs/any_model.md).
_base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', '../_base_/norms/bcn-ws.py']
pretrained = 'checkpoints/resnet50_bcn-ws_in1k.pth'
backbone_init = dict(
    _delete_=True,
    type='PretrainedBackbone',
    checkpoint=pretrained,
    produced_by="convert the WS/BCN authors' released BCN+WS ResNet-50 "
    '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization): python tools/convert_checkpoint.py '
    f'RELEASED.pth {pretrained} --to mmdet --from authors; or pretrain it (90 epochs): '
    'python tools/train.py configs/imagenet/resnet50_bcn-ws_in1k.py && '
    'python tools/convert_checkpoint.py work_dirs/resnet50_bcn-ws_in1k/epoch_90.pth '
    f'{pretrained} --to mmdet')
model = dict(
    backbone=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg),
    bbox_head=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg))
