# DeepLabV3 R-101, output stride 16, GroupNorm (32 groups) in the backbone and the ASPP head.
# WS/BCN paper Table 11 (paper figure, not reproduced here): 74.90 mIoU on VOC 2012 val.
#
# Batch size 1 / ASPP image pooling (1x1 map): GN normalizes each image on its own (over the 8
# channels of a group at the pooled pixel), so any batch size works, 1 included.
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the GN ImageNet weights instead
    backbone=dict(
        norm_cfg=norm_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='checkpoints/resnet101-v1c_gn_in1k.pth',
            produced_by='python tools/train.py configs/imagenet/resnet101-v1c_gn_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101-v1c_gn_in1k/epoch_90.pth '
            'checkpoints/resnet101-v1c_gn_in1k.pth --to mmseg')),
    decode_head=dict(norm_cfg=norm_cfg))
