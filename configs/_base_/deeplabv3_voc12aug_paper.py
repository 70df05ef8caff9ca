# DeepLabV3 R-101 on PASCAL VOC 2012 + SBD ("voc12aug", 10,582 training images) with the settings
# of the WS/BCN paper ("Micro-Batch Training with Batch-Channel Normalization and Weight
# Standardization", arXiv:1903.10520), Sec. 8.4 / Table 11:
#   batch size 16, crop 513, poly learning rate from 0.007, 30k iterations, output stride 16 for
#   training and testing, multi-grid (1, 1, 1), single-scale test without flipping.
# Table 11's BN (76.49) and GN+WS (77.20) numbers are those of the DeepLabV3 reference code the
# paper used (github.com/chenxi116/DeepLabv3.pytorch); where the paper is silent this file follows
# that code: ASPP with 256 channels and rates (6, 12, 18) at stride 16, image pooling, no auxiliary
# head, no dropout, SGD momentum 0.9, weight decay 1e-4 on all parameters, poly power 0.9 down to 0,
# training augmentation = random scale 0.5-2.0 of the original image + random 513 crop + flip,
# test on the original image. Differences from that code: mmseg's ASPP fuses the branches with a
# 3x3 conv (reference: 1x1) and its ImageNet backbones are ResNet-V1c (3-conv deep stem, as the
# authors' "beta" ResNet) rather than torchvision's 7x7-stem ResNet.
#
# This file is the BN baseline (SyncBN everywhere, mmseg's ImageNet weights); the normdense
# variants in configs/deeplabv3/ override norm_cfg / conv_cfg / the backbone init. Every leaf:
#   deeplabv3_r{101,50}-d{16,8}_<norm>[-micro]_voc12aug-513x513.py, see docs/segmentation.md.
#
# Batch: 16 images per iteration = 4 GPUs x 4 images (tools/dist_train.sh CONFIG 4). On another
# GPU count keep 16 in total (e.g. 8 x 2 with train_dataloader.batch_size=2) or pass
# --auto-scale-lr (lr scaled by total batch / 16).
_base_ = 'mmseg::deeplabv3/deeplabv3_r101-d8_4xb4-20k_voc12aug-512x512.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

crop_size = (513, 513)
norm_cfg = dict(type='SyncBN', requires_grad=True)
model = dict(
    data_preprocessor=dict(size=crop_size),
    pretrained='open-mmlab://resnet101_v1c',
    backbone=dict(
        depth=101,
        # output stride 16: only layer4 is dilated; contract_dilation gives its first block
        # dilation 1 (as the reference code), multi_grid=None is the paper's (1, 1, 1)
        strides=(1, 2, 2, 1),
        dilations=(1, 1, 1, 2),
        multi_grid=None,
        contract_dilation=True,
        norm_cfg=norm_cfg,
        norm_eval=False),
    decode_head=dict(
        channels=256,
        dilations=(1, 6, 12, 18),  # 1 = the 1x1 branch; (1, 12, 24, 36) at output stride 8
        dropout_ratio=0.0,
        num_classes=21,
        norm_cfg=norm_cfg),
    auxiliary_head=None)

# VOC images are at most 500 px on their long side, so scale=(500, 500) with ratio_range
# (0.5, 2.0) rescales the original image by a factor in [0.5, 2.0] as the reference code does.
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='RandomResize', scale=(500, 500), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size),
    dict(type='RandomFlip', prob=0.5),
    dict(type='Pad', size=crop_size),  # image padded with 0, labels with 255 (ignored)
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs'),
]
dataset_type = 'PascalVOCDataset'
data_root = 'data/VOCdevkit/VOC2012'
dataset_train = dict(
    type=dataset_type,
    data_root=data_root,
    data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClass'),
    ann_file='ImageSets/Segmentation/train.txt',
    pipeline=train_pipeline)
dataset_aug = dict(
    type=dataset_type,
    data_root=data_root,
    data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClassAug'),
    ann_file='ImageSets/Segmentation/aug.txt',
    pipeline=train_pipeline)
train_dataloader = dict(
    batch_size=4,
    dataset=dict(type='ConcatDataset', datasets=[dataset_train, dataset_aug]))
val_dataloader = dict(
    batch_size=1,
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClass'),
        ann_file='ImageSets/Segmentation/val.txt',
        pipeline=test_pipeline))
test_dataloader = val_dataloader

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='SGD', lr=0.007, momentum=0.9, weight_decay=1e-4),
    clip_grad=None)
param_scheduler = [
    dict(type='PolyLR', eta_min=0.0, power=0.9, begin=0, end=30000, by_epoch=False),
]
train_cfg = dict(type='IterBasedTrainLoop', max_iters=30000, val_interval=3000)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=3000))
# the learning rate above is for 16 images per iteration (all GPUs together)
auto_scale_lr = dict(enable=False, base_batch_size=16)
