# DeepLabV3 R-101, output stride 16, Batch-Channel Normalization (32 groups) + Weight
# Standardization in the backbone and the ASPP head (every ConvModule; the final 1x1 classifier
# stays a plain conv). WS/BCN paper Table 11 (paper figure, not reproduced here): 78.22 mIoU on
# VOC 2012 val.
# BCN runs in the micro-batch mode of the paper's Algorithm 1 (mode='estimate'): its batch stage
# normalizes with estimated statistics that BCNRateHook moves at rate r = the current learning
# rate, so no layer depends on how many images a GPU holds. For large per-GPU batches the
# batch-statistics form (Eq. 43) is --cfg-options with norm mode='batch' in backbone and
# decode_head (then the hook does nothing, and batch size 1 no longer works, see below).
#
# Batch size 1 / ASPP image pooling (1x1 map): the estimate-mode batch stage uses the estimates,
# not the current batch, and the channel stage is per image, so any batch size works, 1 included.
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

conv_cfg = dict(type='WSConv2d')
norm_cfg = dict(type='BCN', num_groups=32, mode='estimate')
model = dict(
    pretrained=None,  # the backbone's init_cfg loads the BCN+WS ImageNet weights instead
    backbone=dict(
        conv_cfg=conv_cfg,
        norm_cfg=norm_cfg,
        init_cfg=dict(
            type='PretrainedBackbone',
            checkpoint='checkpoints/resnet101-v1c_bcn-ws_in1k.pth',
            produced_by="fast path: convert the WS/BCN authors' released BCN+WS ResNet-101 "
            '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization; 7x7 stem): python tools/convert_checkpoint.py '
            'RELEASED.pth checkpoints/resnet101_bcn-ws_authors.pth --to mmseg --from authors, then train with '
            '--cfg-options model.backbone.type=ResNet model.backbone.init_cfg.checkpoint=checkpoints/resnet101_bcn-ws_authors.pth; '
            'or pretrain the V1c backbone (90 epochs): '
            'python tools/train.py configs/imagenet/resnet101-v1c_bcn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101-v1c_bcn-ws_in1k/epoch_90.pth '
            'checkpoints/resnet101-v1c_bcn-ws_in1k.pth --to mmseg')),
    decode_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg))

custom_hooks = [dict(type='BCNRateHook')]  # required by mode='estimate': r = learning rate
