# Small Mask R-CNN (ResNet-18, 64-channel FPN) with Unitization (estimate mode) in the backbone, neck
# and heads, on the toy COCO set (tools/make_toy_coco.py). Used to make
# docs/figures/norm_diagnostics_example.png (see docs/diagnostics.md); also records diagnostics
# during training with NormDiagnosticsHook.
_base_ = 'mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py'
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

data_root = 'data/toy_coco/'
metainfo = dict(classes=('circle', 'rectangle', 'ring', 'star', 'triangle'))
norm_cfg = dict(type='Unitization', mode='estimate', requires_grad=True)
ch = 64
model = dict(
    backbone=dict(depth=18, norm_cfg=norm_cfg, norm_eval=False, init_cfg=None),
    neck=dict(in_channels=[64, 128, 256, 512], out_channels=ch, norm_cfg=norm_cfg),
    rpn_head=dict(in_channels=ch, feat_channels=ch),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=ch),
        bbox_head=dict(type='Shared4Conv1FCBBoxHead', in_channels=ch, conv_out_channels=ch,
                       fc_out_channels=256, num_classes=5, norm_cfg=norm_cfg),
        mask_roi_extractor=dict(out_channels=ch),
        mask_head=dict(in_channels=ch, conv_out_channels=ch, num_classes=5, norm_cfg=norm_cfg)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=500, max_per_img=300),
                   rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=100)))

pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(160, 160), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(160, 160), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_train.json',
                 data_prefix=dict(img='train/'), pipeline=pipeline))
val_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_val.json',
                 data_prefix=dict(img='val/'), pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=40, val_interval=1000)
optim_wrapper = dict(optimizer=dict(lr=0.02),
                     paramwise_cfg=dict(custom_keys={'.alpha': dict(decay_mult=0.0)}))
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=10)]
default_hooks = dict(logger=dict(interval=5),
                     checkpoint=dict(by_epoch=False, interval=20, save_last=False))
custom_hooks = [
    dict(type='BCNRateHook'),
    dict(type='NormDiagnosticsHook', interval=10, layer_types=['Unitization2d'], layer_names=['backbone.*'],
         diagnostics=['statdiff', 'power', 'em_distance'], max_samples=1024),
]
