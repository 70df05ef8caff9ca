# What users type: Mask R-CNN R-50-FPN with BCN+WS (micro-batch estimate mode) in the backbone, FPN,
# 4conv1fc box head and mask head, 2x schedule, 2 images per GPU, loading the converted BCN+WS
# ImageNet backbone from checkpoints/resnet50_bcn-ws_in1k.pth.
_base_ = './mask_rcnn/mask-rcnn_r50_fpn_bcn-ws_2x_coco.py'
