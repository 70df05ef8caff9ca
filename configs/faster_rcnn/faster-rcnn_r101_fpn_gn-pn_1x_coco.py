# Faster R-CNN R-101-FPN with GN+PN in a PNResNet backbone; FPN and the 4conv1fc box head keep plain
# GN(32) (see configs/mask_rcnn/mask-rcnn_r50_fpn_gn-pn_2x_coco.py for why).
# 1x schedule; 8 GPUs x 2 images with lr 0.02 (use --auto-scale-lr for another total batch size).
_base_ = 'mmdet::faster_rcnn/faster-rcnn_r101_fpn_1x_coco.py'
# Weight decay on every parameter: the PN paper's ResNet recipe (mmdet's default optimizer settings).
# configs/_base_/proxy_norm.py documents its EfficientNet recipe for those who want it.
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
custom_hooks = [dict(type='ProxyNormCheckHook')]
pretrained = 'checkpoints/resnet101_gn-pn_in1k.pth'
gn = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    backbone=dict(
        _delete_=True,
        type='PNResNet',
        depth=101,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        frozen_stages=1,
        norm_cfg=dict(type='GNPN', num_groups=32),
        norm_eval=False,
        style='pytorch',
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint=pretrained,
            produced_by='python tools/train.py configs/imagenet/resnet101_gn-pn_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101_gn-pn_in1k/epoch_90.pth '
            f'{pretrained} --to mmdet')),
    neck=dict(norm_cfg=gn),
    roi_head=dict(bbox_head=dict(type='Shared4Conv1FCBBoxHead', conv_out_channels=256, norm_cfg=gn)))
