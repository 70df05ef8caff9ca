# ResNet-101 with the deep stem of ResNetV1c (three 3x3 convs; mmseg's DeepLabV3 backbone), ImageNet-1k pretraining.
# GN+PN (Labatie et al.): PNResNet, every norm followed by a ReLU is GroupNorm(32) + proxy-normalized
# activation; the norms before the residual add / in the downsample branch are plain GN(32). Weight decay on
# all parameters (the PN paper's ResNet recipe). ProxyNormCheckHook fails fast on a misplaced activation.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        _delete_=True,
        type='PNResNetV1c',
        depth=101,
        num_stages=4,
        out_indices=(3, ),
        style='pytorch',
        norm_cfg=dict(type='GNPN', num_groups=32)))
custom_hooks = [dict(type='ProxyNormCheckHook')]
