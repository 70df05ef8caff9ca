# DeepLabV3 R-50: deeplabv3_r101-d16_bcn-ws-micro_voc12aug-513x513.py
# with a ResNet-50 V1c backbone: checkpoints/resnet50-v1c_bcn-ws_in1k.pth.
# No paper figure for R-50 (Table 11 is R-101 only).
_base_ = './deeplabv3_r101-d16_bcn-ws-micro_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        depth=50,
        init_cfg=dict(
            checkpoint='checkpoints/resnet50-v1c_bcn-ws_in1k.pth',
            produced_by="fast path: convert the WS/BCN authors' released BCN+WS ResNet-50 "
            '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization; 7x7 stem): python tools/convert_checkpoint.py '
            'RELEASED.pth checkpoints/resnet50_bcn-ws_authors.pth --to mmseg --from authors, then train with '
            '--cfg-options model.backbone.type=ResNet model.backbone.init_cfg.checkpoint=checkpoints/resnet50_bcn-ws_authors.pth; '
            'or pretrain the V1c backbone (90 epochs): '
            'python tools/train.py configs/imagenet/resnet50-v1c_bcn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet50-v1c_bcn-ws_in1k/epoch_90.pth '
            'checkpoints/resnet50-v1c_bcn-ws_in1k.pth --to mmseg')))
