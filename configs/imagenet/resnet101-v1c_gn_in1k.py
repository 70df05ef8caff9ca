# ResNet-101 with the deep stem of ResNetV1c (three 3x3 convs; mmseg's DeepLabV3 backbone), ImageNet-1k pretraining.
# GN baseline: GroupNorm(32), plain convs (the WS paper trains it at 1 image/GPU; GN is batch-independent,
# so 64 images/GPU gives the same gradients and only needs more memory).
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        type='ResNetV1c',
        depth=101,
        norm_cfg=dict(type='GN', num_groups=32, requires_grad=True)))
