# DeepLabV3 R-101, output stride 16, GroupNorm + Proxy Normalization (PN paper, Sec. 5). No paper
# figure exists for segmentation. The activation lives inside the GNPN norm layer:
# * backbone: PNResNetV1c (every "norm -> ReLU" is a GNPN; the norm before the residual add and
#   the downsample norm stay plain GN), see docs/proxy_norm.md;
# * ASPP head: GNPN in every ConvModule with act_cfg=None (no second ReLU);
# * ProxyNormCheckHook fails fast if an activation ends up on top of a GNPN.
# Weight decay: like every variant here (and the PN paper's ResNet recipe) it applies to all
# parameters; configs/_base_/proxy_norm.py's EfficientNet recipe (norm_decay_mult=0 except the
# proxy parameters) is not used. (It cannot be a second _base_ here anyway: mmengine forbids keys
# such as optim_wrapper being defined by two sibling bases.)
#
# Batch size 1 / ASPP image pooling (1x1 map): GN is per image and PN's proxy statistics depend on
# parameters only, so any batch size works, 1 included.
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

pn_cfg = dict(type='GNPN', num_groups=32)
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the GN+PN ImageNet weights instead
    backbone=dict(
        type='PNResNetV1c',
        norm_cfg=pn_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='checkpoints/resnet101-v1c_gn-pn_in1k.pth',
            produced_by='python tools/train.py configs/imagenet/resnet101-v1c_gn-pn_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101-v1c_gn-pn_in1k/epoch_90.pth '
            'checkpoints/resnet101-v1c_gn-pn_in1k.pth --to mmseg')),
    decode_head=dict(norm_cfg=pn_cfg, act_cfg=None))

custom_hooks = [dict(type='ProxyNormCheckHook')]
