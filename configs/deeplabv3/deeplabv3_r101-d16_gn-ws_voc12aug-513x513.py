# DeepLabV3 R-101, output stride 16, GN (32 groups) + Weight Standardization in the backbone and
# the ASPP head (every ConvModule; the final 1x1 classifier stays a plain conv, as in the paper).
# WS/BCN paper Table 11 (paper figure, not reproduced here): 77.20 mIoU on VOC 2012 val.
#
# Batch size 1 / ASPP image pooling (1x1 map): GN is per image and WS acts on the weights, so any
# batch size works, 1 included.
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

# Backbone: the WS authors' GN+WS ImageNet ResNet-101 that mmdet hosts (open-mmlab://jhu/resnet101_gn_ws),
# loaded by mmengine's checkpoint loader (downloaded once, cached under $TORCH_HOME), weights-only. It has
# the plain 7x7 stem, so the backbone is mmseg's ResNet (deep_stem=False) rather than the V1c of the other
# variants; its keys (conv1, gn1, layerN.M.gn1-3, downsample.0/1: mmcv names GroupNorm 'gn') load strictly,
# an ImageNet classifier head ('fc.') is left out (logged). The weights were trained with mmcv's ConvWS,
# w / (std_unbiased + 1e-5), so formula='std_unbiased' (the same function up to float rounding), also in the head.
# From our own pretraining instead (configs/imagenet/resnet101-v1c_gn-ws_in1k.py + tools/convert_checkpoint.py):
#   --cfg-options model.backbone.type=ResNetV1c model.backbone.init_cfg.checkpoint=<converted .pth>
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the GN+WS ImageNet weights instead
    backbone=dict(
        type='ResNet',
        conv_cfg=conv_cfg,
        norm_cfg=norm_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='open-mmlab://jhu/resnet101_gn_ws',
            drop_prefixes=('fc.',))),
    decode_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))
