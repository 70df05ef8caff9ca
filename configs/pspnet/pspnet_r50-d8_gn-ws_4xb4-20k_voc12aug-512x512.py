# PSPNet R-50-D8 on VOC 2012 + SBD, GN+WS.
# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, the PSP head (pyramid pooling with its 1x1 pooled branch, bottleneck) and the
# auxiliary FCN head; the 1x1 classifiers (conv_seg) stay plain.
_base_ = ['mmseg::pspnet/pspnet_r50-d8_4xb4-20k_voc12aug-512x512.py']
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
