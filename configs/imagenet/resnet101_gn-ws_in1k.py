# ResNet-101 (plain 7x7 stem, mmdet's ResNet), ImageNet-1k pretraining.
# GN+WS: GroupNorm(32) after weight-standardized convs (WS formula 'paper', Eq. 7). The paper trains it
# at 1 image/GPU with 64-iteration accumulation; GN+WS is batch-independent, so 64 images/GPU gives the same
# gradients.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        depth=101,
        conv_cfg=dict(type='WSConv2d'),
        norm_cfg=dict(type='GN', num_groups=32, requires_grad=True)))
