# UPerNet R-50 on ADE20K, GN+WS.
# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, the UPerHead (PPM, laterals, FPN convs, bottlenecks) and the auxiliary FCN head;
# the 1x1 classifiers (conv_seg) stay plain. GN and estimate-mode BCN need no batch statistics, so the
# PPM's 1x1 pooled branch works at any batch size.
_base_ = ['mmseg::upernet/upernet_r50_4xb4-80k_ade20k-512x512.py']
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 (open-mmlab://jhu/resnet50_gn_ws): a 7x7 stem, so mmseg's
# ResNet (not V1c); trained with mmcv's ConvWS, so formula='std_unbiased' everywhere.
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
backbone = dict(
    type='ResNet',
    init_cfg=dict(type='PretrainedBackbone', checkpoint='open-mmlab://jhu/resnet50_gn_ws', drop_prefixes=('fc.', )))
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the normdense ImageNet weights
    backbone=dict(backbone, conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    decode_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    auxiliary_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
