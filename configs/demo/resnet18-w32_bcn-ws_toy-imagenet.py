# Toy ImageNet-style pretraining of a half-width ResNet-18 with BCN+WS, the first step of the demo chain
# pretrain -> tools/convert_checkpoint.py -> fine-tune (docs/pretraining.md):
#   python tools/make_toy_imagenet.py                          # data/toy_imagenet: 5000 train / 100 val, 5 shapes
#   python tools/train.py configs/demo/resnet18-w32_bcn-ws_toy-imagenet.py
#   python tools/convert_checkpoint.py work_dirs/resnet18-w32_bcn-ws_toy-imagenet/iter_3000.pth \
#       checkpoints/resnet18-w32_bcn-ws_toy.pth --to mmdet
# Same layers as the detection demo (configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py): WS convs
# (formula 'paper') and estimate-mode BCN, BCNRateHook (r = lr), here at 8 images per batch on 64x64
# random-resized crops of the 160x160 toy images (the dominant shape then has about the size of the toy
# COCO objects at 160x160) so that it runs on 2 CPU cores in a few minutes; evaluation resizes to 80 and
# center-crops 64 (the same object scale as the training crops). Crops keep 60-100 % of the image
# (smaller ones often cut the dominant shape, i.e. its class, away) and SGD runs at lr 0.1.
# Half width (stem and base channels 32, 16 BCN groups: the same 2-16 channels per group as the paper's
# 32 groups at full width) because the detection demo's step is then 2x faster, and the time saved goes
# into iterations: 3000 here (top-1 78-79 % at 1000-1500, 84-98 % at 2000, 86-98 % at 3000 over seeds)
# and 2000 in the fine-tuning.
# The runs behind these choices, and those of the former full-width config, are in docs/pretraining.md.
_base_ = ['mmpretrain::_base_/models/resnet18.py', 'mmpretrain::_base_/default_runtime.py']
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

data_root = 'data/toy_imagenet'
classes = ('circle', 'rectangle', 'ring', 'star', 'triangle')
max_iters = 3000
crop = 64

model = dict(
    backbone=dict(stem_channels=32, base_channels=32, conv_cfg=dict(type='WSConv2d'),
                  norm_cfg=dict(type='BCN', num_groups=16, mode='estimate')),
    head=dict(in_channels=256, num_classes=len(classes), topk=(1, )))
data_preprocessor = dict(num_classes=len(classes), mean=[123.675, 116.28, 103.53], std=[58.395, 57.12, 57.375],
                         to_rgb=True)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomResizedCrop', scale=crop, crop_ratio_range=(0.6, 1.0)),
    dict(type='RandomFlip', prob=0.5, direction='horizontal'),
    dict(type='PackInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='ResizeEdge', scale=crop * 5 // 4, edge='short'),
    dict(type='CenterCrop', crop_size=crop),
    dict(type='PackInputs'),
]
train_dataloader = dict(
    batch_size=8, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='ImageNet', data_root=data_root, metainfo=dict(classes=classes), split='train',
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=16, num_workers=0, persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='ImageNet', data_root=data_root, metainfo=dict(classes=classes), split='val',
                 pipeline=test_pipeline))
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_dataloader = val_dataloader
test_evaluator = val_evaluator

train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict()
test_cfg = dict()
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9, weight_decay=1e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=50),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=50, end=max_iters, eta_min=0.0),
]
custom_hooks = [dict(type='BCNRateHook')]
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=1),
    logger=dict(type='LoggerHook', interval=50))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
