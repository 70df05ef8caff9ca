# RetinaNet R-50-FPN, GN+WS.
# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, FPN and the 4+4 head convs shared over the FPN levels (estimate-mode BCN moves its
# estimates once per iteration over all levels' calls); the cls/reg predictors stay plain convs.
# A diff over mmdet's config; the same model as `normdense_norm = 'gn-ws'` (docs/any_model.md).
_base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', '../_base_/norms/gn-ws.py']
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 (open-mmlab://jhu/resnet50_gn_ws, trained with mmcv's
# ConvWS: formula='std_unbiased', used in every WS conv as mmdet's configs/gn+ws/ do).
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
backbone_init = dict(_delete_=True, type='PretrainedBackbone', checkpoint='open-mmlab://jhu/resnet50_gn_ws',
                     drop_prefixes=('fc.', ))
model = dict(
    backbone=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    bbox_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
