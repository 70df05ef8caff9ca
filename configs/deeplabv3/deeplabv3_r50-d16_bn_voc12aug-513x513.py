# DeepLabV3 R-50: deeplabv3_r101-d16_bn_voc12aug-513x513.py
# with a ResNet-50 V1c backbone: mmseg's ImageNet BN weights open-mmlab://resnet50_v1c.
# No paper figure for R-50 (Table 11 is R-101 only).
_base_ = './deeplabv3_r101-d16_bn_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

model = dict(pretrained='open-mmlab://resnet50_v1c', backbone=dict(depth=50))
