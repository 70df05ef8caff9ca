# ResNet-101 (plain 7x7 stem, mmdet's ResNet), ImageNet-1k pretraining.
# IterNorm (Huang et al.): group-wise whitening by Newton's iteration (64 channels per group, T=5) in
# every norm slot of the backbone (the 'all norms' placement, as the detection/segmentation configs; the
# paper's main ImageNet setting whitens only the first norm), plain convs, 64 images/GPU.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        depth=101,
        norm_cfg=dict(type='IterNorm', group_size=64, T=5)))
