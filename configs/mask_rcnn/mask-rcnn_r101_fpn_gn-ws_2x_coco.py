# Mask R-CNN R-101-FPN: the R-50 config with a ResNet-101 backbone and the WS authors' GN+WS ImageNet
# ResNet-101 that mmdet hosts (open-mmlab://jhu/resnet101_gn_ws; WS formula 'std_unbiased', see the R-50 config).
_base_ = './mask-rcnn_r50_fpn_gn-ws_2x_coco.py'
model = dict(backbone=dict(depth=101, init_cfg=dict(checkpoint='open-mmlab://jhu/resnet101_gn_ws')))
