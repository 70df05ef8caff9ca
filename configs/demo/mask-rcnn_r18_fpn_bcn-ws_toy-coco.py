# `make demo`: the BCN+WS Mask R-CNN recipe of configs/mask_rcnn_r50_fpn_bcn_ws.py shrunk to run on
# 2 CPU cores in minutes. Stated plainly, what is smaller than the paper's setting:
# * backbone: a half-width ResNet-18 (stem and base channels 32, not 64; BCN with 16 groups, the paper's
#   channels per group) pretrained on toy ImageNet (configs/demo/resnet18-w32_bcn-ws_toy-imagenet.py,
#   3000 iterations on 64x64 crops) and converted with tools/convert_checkpoint.py -- `make
#   demo` does both when checkpoints/resnet18-w32_bcn-ws_toy.pth is missing (from scratch:
#   model.backbone.init_cfg=None);
# * 64-channel FPN and heads (not 256), 32 sampled RoIs per image, up to half of them positive (not 512
#   with a quarter: the 4conv1fc box head runs on every sampled RoI);
# * 160x160 toy COCO images (`tools/make_toy_coco.py --num-train 1000`, as `make demo` runs it: with the
#   tool's default 256 train images the longer schedule over-fits), 2 images per batch, 2000 iterations
#   with lr 0.02, 100 warm-up iterations and cosine decay (not 24 epochs).
# Half width and 64 channels make a step about 2x faster than a full-width ResNet-18 with 128-channel
# heads, and the time goes into twice the iterations (the measurements, with the alternatives tried -- a
# 2-conv mask head, RoI-to-level mappings scaled to the small images, frozen stem and stage 1 -- are
# documented with the demo's results).
# What stays the same: WS convs + estimate-mode BCN(32 groups; 16 in the half-width backbone) in backbone,
# FPN, 4conv1fc box head and mask head; BCNRateHook (r = lr); mmdet's CocoMetric for bbox/segm AP.
_base_ = '../mask_rcnn/mask-rcnn_r50_fpn_bcn-ws_2x_coco.py'

data_root = 'data/toy_coco/'
classes = ('circle', 'rectangle', 'ring', 'star', 'triangle')
width = 64
max_iters = 2000
pretrained = 'checkpoints/resnet18-w32_bcn-ws_toy.pth'

model = dict(
    backbone=dict(
        depth=18,
        base_channels=32,
        norm_cfg=dict(type='BCN', num_groups=16, mode='estimate'),
        frozen_stages=-1,
        init_cfg=dict(
            checkpoint=pretrained,
            produced_by='python tools/make_toy_imagenet.py && python tools/train.py '
            'configs/demo/resnet18-w32_bcn-ws_toy-imagenet.py && python tools/convert_checkpoint.py '
            f'work_dirs/resnet18-w32_bcn-ws_toy-imagenet/iter_3000.pth {pretrained} --to mmdet (or: make demo)')),
    neck=dict(in_channels=[32, 64, 128, 256], out_channels=width),
    rpn_head=dict(in_channels=width, feat_channels=width),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=width),
        bbox_head=dict(in_channels=width, conv_out_channels=width, fc_out_channels=2 * width,
                       num_classes=len(classes)),
        mask_roi_extractor=dict(out_channels=width),
        mask_head=dict(in_channels=width, conv_out_channels=width, num_classes=len(classes))),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=1000, max_per_img=300),
        rcnn=dict(sampler=dict(num=32, pos_fraction=0.5))),
    test_cfg=dict(rpn=dict(nms_pre=500, max_per_img=300)))

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(160, 160), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs')
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(160, 160), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))
]
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    batch_sampler=None,
    dataset=dict(data_root=data_root, metainfo=dict(classes=classes), ann_file='annotations/instances_train.json',
                 data_prefix=dict(img='train/'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=dict(classes=classes), ann_file='annotations/instances_val.json',
                 data_prefix=dict(img='val/'), pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=100),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=100, end=max_iters, T_max=max_iters - 100, eta_min=0.0)
]
optim_wrapper = dict(optimizer=dict(lr=0.02))
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=1),
    logger=dict(type='LoggerHook', interval=50))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
