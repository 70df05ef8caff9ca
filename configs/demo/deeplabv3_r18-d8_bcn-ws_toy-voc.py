# Toy-VOC demo (make demo-seg): the DeepLabV3 BCN+WS config
# configs/deeplabv3/deeplabv3_r101-d8_bcn-ws_voc12aug-513x513.py -- estimate-mode BCN (32 groups)
# + WS convs in backbone and ASPP head, BCNRateHook -- shrunk to train on CPU in a few minutes:
# ResNet-18 V1c from scratch (no ImageNet backbone exists for it), output stride 8, 128x128 crops,
# 2 images per batch, ASPP rates scaled to the 16x16 feature map. Data: tools/make_toy_voc.py
# (docs/toy_data.md), 160x160 images, the 5 toy shapes on VOC labels 1-5, train + aug split as
# mmseg's pascal_voc12_aug.py. The head predicts VOC's first 6 classes (background + labels 1-5,
# a subset mmseg's PascalVOCDataset accepts), so mIoU is over those 6.
# Batch size 1 works as in the R-101 config (estimate-mode BCN needs no batch statistics).
_base_ = '../deeplabv3/deeplabv3_r101-d8_bcn-ws_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

crop_size = (128, 128)
num_classes = 6
model = dict(
    data_preprocessor=dict(size=crop_size),
    backbone=dict(depth=18, init_cfg=None),  # from scratch
    decode_head=dict(
        in_channels=512,
        channels=128,
        dilations=(1, 3, 6, 9),  # (1, 12, 24, 36) at 513 px / stride 8 scaled to a 16x16 map
        num_classes=num_classes))

data_root = 'data/toy_voc/VOCdevkit/VOC2012'
metainfo = dict(classes=('background', 'aeroplane', 'bicycle', 'bird', 'boat', 'bottle'))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='RandomResize', scale=(160, 160), ratio_range=(0.75, 1.5), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size),
    dict(type='RandomFlip', prob=0.5),
    dict(type='Pad', size=crop_size),
    dict(type='PackSegInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations'),
    dict(type='PackSegInputs'),
]
dataset_train = dict(
    type='PascalVOCDataset',
    data_root=data_root,
    metainfo=metainfo,
    data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClass'),
    ann_file='ImageSets/Segmentation/train.txt',
    pipeline=train_pipeline)
dataset_aug = dict(
    type='PascalVOCDataset',
    data_root=data_root,
    metainfo=metainfo,
    data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClassAug'),
    ann_file='ImageSets/Segmentation/aug.txt',
    pipeline=train_pipeline)
train_dataloader = dict(
    batch_size=2,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(type='ConcatDataset', datasets=[dataset_train, dataset_aug]))
val_dataloader = dict(
    batch_size=1,
    num_workers=0,
    persistent_workers=False,
    dataset=dict(
        type='PascalVOCDataset',
        data_root=data_root,
        metainfo=metainfo,
        data_prefix=dict(img_path='JPEGImages', seg_map_path='SegmentationClass'),
        ann_file='ImageSets/Segmentation/val.txt',
        pipeline=test_pipeline))
test_dataloader = val_dataloader

max_iters = 1000
optim_wrapper = dict(optimizer=dict(lr=0.02, momentum=0.9, weight_decay=1e-4))
param_scheduler = [
    dict(type='PolyLR', eta_min=0.0, power=0.9, begin=0, end=max_iters, by_epoch=False),
]
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
default_hooks = dict(
    logger=dict(interval=50),
    checkpoint=dict(interval=max_iters, max_keep_ckpts=1))
env_cfg = dict(cudnn_benchmark=False)
randomness = dict(seed=0)
