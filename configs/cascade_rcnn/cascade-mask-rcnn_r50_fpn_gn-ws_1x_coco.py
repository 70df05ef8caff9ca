# Cascade Mask R-CNN R-50-FPN, GN+WS.
# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, FPN and the mask heads (4 convs each); the three cascade box heads keep
# mmdet's Shared2FCBBoxHead (fully connected: no conv or norm layer); RPN head and predictors plain.
_base_ = ['mmdet::cascade_rcnn/cascade-mask-rcnn_r50_fpn_1x_coco.py', '../_base_/norms/gn-ws.py']
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 (open-mmlab://jhu/resnet50_gn_ws, trained with mmcv's
# ConvWS: formula='std_unbiased', used in every WS conv as mmdet's configs/gn+ws/ do).
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
backbone_init = dict(_delete_=True, type='PretrainedBackbone', checkpoint='open-mmlab://jhu/resnet50_gn_ws',
                     drop_prefixes=('fc.', ))
model = dict(
    backbone=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    roi_head=dict(mask_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg)))
