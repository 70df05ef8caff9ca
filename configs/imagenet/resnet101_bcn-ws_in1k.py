# ResNet-101 (plain 7x7 stem, mmdet's ResNet), ImageNet-1k pretraining.
# BCN+WS, large batch (the paper's ImageNet BCN+WS, Table 6): BCN in mode='batch' (its first stage is
# a BatchNorm over the 64 images of each GPU, not synchronized), 32 groups, WS convs (formula 'paper').
# The checkpoint converts to the estimate-mode BCN of the detection/segmentation configs (same keys: the
# running statistics become the estimates).
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        depth=101,
        conv_cfg=dict(type='WSConv2d'),
        norm_cfg=dict(type='BCN', num_groups=32, mode='batch')))
