# ResNet-101 with the deep stem of ResNetV1c (three 3x3 convs; mmseg's DeepLabV3 backbone), ImageNet-1k pretraining.
# IterNorm (Huang et al.): group-wise whitening by Newton's iteration (64 channels per group, T=5) in
# every norm slot of the backbone (the 'all norms' placement, as the detection/segmentation configs; the
# paper's main ImageNet setting whitens only the first norm), plain convs, 64 images/GPU.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        type='ResNetV1c',
        depth=101,
        norm_cfg=dict(type='IterNorm', group_size=64, T=5)))
