# Mask R-CNN R-50-FPN with GN+PN (Labatie et al., Eq. 7): PNResNet backbone in which every norm followed
# by a ReLU is GroupNorm + proxy-normalized activation (the ReLU lives inside the layer). FPN and the
# box/mask heads keep plain GN(32): FPN has no activation after its norms, and mmdet's
# Shared4Conv1FCBBoxHead/FCNMaskHead hard-code ReLU after theirs (ProxyNormCheckHook enforces this).
# 2x schedule; 8 GPUs x 2 images with lr 0.02 (use --auto-scale-lr for another total batch size).
_base_ = 'mmdet::mask_rcnn/mask-rcnn_r50_fpn_2x_coco.py'
# Weight decay on every parameter: the PN paper's ResNet recipe (mmdet's default optimizer settings).
# configs/_base_/proxy_norm.py documents its EfficientNet recipe for those who want it.
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
custom_hooks = [dict(type='ProxyNormCheckHook')]
pretrained = 'checkpoints/resnet50_gn-pn_in1k.pth'
gn = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    backbone=dict(
        _delete_=True,
        type='PNResNet',
        depth=50,
        num_stages=4,
        out_indices=(0, 1, 2, 3),
        frozen_stages=1,
        norm_cfg=dict(type='GNPN', num_groups=32),
        norm_eval=False,
        style='pytorch',
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint=pretrained,
            produced_by='python tools/train.py configs/imagenet/resnet50_gn-pn_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet50_gn-pn_in1k/epoch_90.pth '
            f'{pretrained} --to mmdet')),
    neck=dict(norm_cfg=gn),
    roi_head=dict(
        bbox_head=dict(type='Shared4Conv1FCBBoxHead', conv_out_channels=256, norm_cfg=gn),
        mask_head=dict(norm_cfg=gn)))
