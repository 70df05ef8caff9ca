# DeepLabV3 R-50: deeplabv3_r101-d16_gn-ws-micro_voc12aug-513x513.py
# with a ResNet-50 backbone: the WS authors' GN+WS ImageNet weights (open-mmlab://jhu/resnet50_gn_ws).
# No paper figure for R-50 (Table 11 is R-101 only).
_base_ = './deeplabv3_r101-d16_gn-ws-micro_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

model = dict(
    backbone=dict(
        depth=50,
        init_cfg=dict(checkpoint='open-mmlab://jhu/resnet50_gn_ws')))
