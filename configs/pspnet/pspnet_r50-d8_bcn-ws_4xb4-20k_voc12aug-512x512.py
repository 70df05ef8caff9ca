# PSPNet R-50-D8 on VOC 2012 + SBD, BCN+WS.
# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): estimate-mode BCN, r = lr (EstimateRateHook
# from ../_base_/norms/bcn-ws.py).
# Layers in the backbone, the PSP head (pyramid pooling with its 1x1 pooled branch, bottleneck) and the
# auxiliary FCN head; the 1x1 classifiers (conv_seg) stay plain.
_base_ = ['mmseg::pspnet/pspnet_r50-d8_4xb4-20k_voc12aug-512x512.py']
# (not inheriting ../_base_/norms/bcn-ws.py: mmseg's config defines norm_cfg too, a duplicate key among bases)
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
conv_cfg = dict(type='WSConv2d')
norm_cfg = dict(type='BCN', num_groups=32, mode='estimate')
custom_hooks = [dict(type='EstimateRateHook')]
pretrained = 'checkpoints/resnet50-v1c_bcn-ws_in1k.pth'
backbone = dict(
    init_cfg=dict(
        type='PretrainedBackbone',
        checkpoint=pretrained,
        produced_by='python tools/train.py configs/imagenet/resnet50-v1c_bcn-ws_in1k.py && '
        'python tools/convert_checkpoint.py work_dirs/resnet50-v1c_bcn-ws_in1k/epoch_90.pth '
        f'{pretrained} --to mmseg'))
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the normdense ImageNet weights
    backbone=dict(backbone, conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    decode_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    auxiliary_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
