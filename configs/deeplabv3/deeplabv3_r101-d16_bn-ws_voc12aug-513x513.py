# DeepLabV3 R-101, output stride 16, BN (SyncBN) + Weight Standardization in the backbone and the
# ASPP head (every ConvModule; the final 1x1 classifier stays a plain conv, as in the paper).
# WS/BCN paper Table 11 (paper figure, not reproduced here): 77.15 mIoU on VOC 2012 val.
# The backbone must come from a BN+WS ImageNet model: plain BN weights do not fit WS convs.
#
# Batch size 1 / ASPP image pooling (1x1 map): as the BN baseline, the image-pool BN needs >= 2
# images per (synced) batch; 16 here. For 1-2 images per GPU use
# deeplabv3_r101-d16_bn-ws-micro_voc12aug-513x513.py (GN in the ASPP head).
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

conv_cfg = dict(type='WSConv2d')
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the BN+WS ImageNet weights instead
    backbone=dict(
        conv_cfg=conv_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='checkpoints/resnet101-v1c_bn-ws_in1k.pth',
            produced_by='python tools/train.py configs/imagenet/resnet101-v1c_bn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101-v1c_bn-ws_in1k/epoch_90.pth '
            'checkpoints/resnet101-v1c_bn-ws_in1k.pth --to mmseg')),
    decode_head=dict(conv_cfg=conv_cfg))
