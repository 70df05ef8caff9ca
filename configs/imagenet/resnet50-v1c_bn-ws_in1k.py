# ResNet-50 with the deep stem of ResNetV1c (three 3x3 convs; mmseg's DeepLabV3 backbone), ImageNet-1k pretraining.
# BN+WS: BatchNorm (per-GPU statistics, 64 images/GPU as the paper) after weight-standardized convs.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        type='ResNetV1c',
        depth=50,
        conv_cfg=dict(type='WSConv2d')))
