# DeepLabV3 R-101, output stride 16, GN (32 groups) + Weight Standardization in the backbone and
# the ASPP head (every ConvModule; the final 1x1 classifier stays a plain conv, as in the paper).
# WS/BCN paper Table 11 (paper figure, not reproduced here): 77.20 mIoU on VOC 2012 val.
#
# Batch size 1 / ASPP image pooling (1x1 map): GN is per image and WS acts on the weights, so any
# batch size works, 1 included.
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

conv_cfg = dict(type='WSConv2d')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the GN+WS ImageNet weights instead
    backbone=dict(
        conv_cfg=conv_cfg,
        norm_cfg=norm_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='checkpoints/resnet101-v1c_gn-ws_in1k.pth',
            produced_by='python tools/train.py configs/imagenet/resnet101-v1c_gn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101-v1c_gn-ws_in1k/epoch_90.pth '
            'checkpoints/resnet101-v1c_gn-ws_in1k.pth --to mmseg')),
    decode_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
