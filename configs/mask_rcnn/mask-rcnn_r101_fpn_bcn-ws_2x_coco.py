# Mask R-CNN R-101-FPN: the R-50 config with a ResNet-101 backbone and its converted bcn-ws ImageNet weights.
_base_ = './mask-rcnn_r50_fpn_bcn-ws_2x_coco.py'
pretrained = 'checkpoints/resnet101_bcn-ws_in1k.pth'
model = dict(
    backbone=dict(
        depth=101,
        init_cfg=dict(
            checkpoint=pretrained,
            produced_by="convert the WS/BCN authors' released BCN+WS ResNet-101 "
            '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization): python tools/convert_checkpoint.py '
            f'RELEASED.pth {pretrained} --to mmdet --from authors; or pretrain it (90 epochs): '
            'python tools/train.py configs/imagenet/resnet101_bcn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet101_bcn-ws_in1k/epoch_90.pth '
            f'{pretrained} --to mmdet')))
