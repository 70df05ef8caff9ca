# UPerNet R-50 on ADE20K, BCN+WS.
# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): estimate-mode BCN, r = lr (EstimateRateHook
# from ../_base_/norms/bcn-ws.py).
# Layers in the backbone, the UPerHead (PPM, laterals, FPN convs, bottlenecks) and the auxiliary FCN head;
# the 1x1 classifiers (conv_seg) stay plain. GN and estimate-mode BCN need no batch statistics, so the
# PPM's 1x1 pooled branch works at any batch size.
_base_ = ['mmseg::upernet/upernet_r50_4xb4-80k_ade20k-512x512.py']
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
