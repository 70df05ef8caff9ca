# Cascade Mask R-CNN R-50-FPN, BCN+WS.
# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): estimate-mode BCN, r = lr (EstimateRateHook
# from ../_base_/norms/bcn-ws.py).
# Layers in the backbone, FPN and the mask heads (4 convs each); the three cascade box heads keep
# mmdet's Shared2FCBBoxHead (fully connected: no conv or norm layer); RPN head and predictors plain.
_base_ = ['mmdet::cascade_rcnn/cascade-mask-rcnn_r50_fpn_1x_coco.py', '../_base_/norms/bcn-ws.py']
pretrained = 'checkpoints/resnet50_bcn-ws_in1k.pth'
backbone_init = dict(
    _delete_=True,
    type='PretrainedBackbone',
    checkpoint=pretrained,
    produced_by="convert the WS/BCN authors' released BCN+WS ResNet-50 "
    '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization): python tools/convert_checkpoint.py '
    f'RELEASED.pth {pretrained} --to mmdet --from authors; or pretrain it (90 epochs): '
    'python tools/train.py configs/imagenet/resnet50_bcn-ws_in1k.py && '
    'python tools/convert_checkpoint.py work_dirs/resnet50_bcn-ws_in1k/epoch_90.pth '
    f'{pretrained} --to mmdet')
model = dict(
    backbone=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg, norm_eval=False, init_cfg=backbone_init),
    neck=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg),
    roi_head=dict(mask_head=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg)))
