# FCOS R-50-FPN, BCN+WS.
# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): estimate-mode BCN, r = lr (EstimateRateHook
# from ../_base_/norms/bcn-ws.py).
# Over mmdet's FCOS (GN head) config, with a PyTorch-style backbone (the pretrained normdense backbones
# are PyTorch-style: RGB, ImageNet mean/std) instead of its Caffe one. Layers in the backbone, FPN and
# the head convs shared over the FPN levels; the cls/reg/centerness predictors stay plain convs.
_base_ = ['mmdet::fcos/fcos_r50-caffe_fpn_gn-head_1x_coco.py', '../_base_/norms/bcn-ws.py']
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
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True),
    backbone=dict(style='pytorch', conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg),
    bbox_head=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg))
