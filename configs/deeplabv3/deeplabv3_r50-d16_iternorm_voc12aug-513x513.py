# DeepLabV3 R-50: deeplabv3_r101-d16_iternorm_voc12aug-513x513.py
# with a ResNet-50 V1c backbone: checkpoints/resnet50-v1c_iternorm_in1k.pth.
# No paper figure for R-50 (Table 11 is R-101 only).
_base_ = './deeplabv3_r101-d16_iternorm_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        depth=50,
        init_cfg=dict(
            checkpoint='checkpoints/resnet50-v1c_iternorm_in1k.pth',
            produced_by='python tools/train.py configs/imagenet/resnet50-v1c_iternorm_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet50-v1c_iternorm_in1k/epoch_90.pth '
            'checkpoints/resnet50-v1c_iternorm_in1k.pth --to mmseg')))
