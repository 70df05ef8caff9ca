# FCOS R-50-FPN, GN+WS.
# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Over mmdet's FCOS (GN head) config, with a PyTorch-style backbone (the pretrained normdense backbones
# are PyTorch-style: RGB, ImageNet mean/std) instead of its Caffe one. Layers in the backbone, FPN and
# the head convs shared over the FPN levels; the cls/reg/centerness predictors stay plain convs.
_base_ = ['mmdet::fcos/fcos_r50-caffe_fpn_gn-head_1x_coco.py', '../_base_/norms/gn-ws.py']
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 (open-mmlab://jhu/resnet50_gn_ws, trained with mmcv's
# ConvWS: formula='std_unbiased', used in every WS conv as mmdet's configs/gn+ws/ do).
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
backbone_init = dict(_delete_=True, type='PretrainedBackbone', checkpoint='open-mmlab://jhu/resnet50_gn_ws',
                     drop_prefixes=('fc.', ))
model = dict(
    data_preprocessor=dict(mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375], bgr_to_rgb=True),
    backbone=dict(style='pytorch', conv_cfg=conv_cfg, norm_cfg=norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    bbox_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
