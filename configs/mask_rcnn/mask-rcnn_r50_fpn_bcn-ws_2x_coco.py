# Mask R-CNN R-50-FPN, BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): the batch stage normalizes with
# running estimates updated at rate r = the current learning rate (BCNRateHook, from the norms base).
# Layers in the backbone, FPN, 4conv1fc box head and mask head, as the WS/BCN paper (Sec. 8.3).
# 2x schedule; 8 GPUs x 2 images with lr 0.02 (use --auto-scale-lr for another total batch size).
_base_ = ['mmdet::mask_rcnn/mask-rcnn_r50_fpn_2x_coco.py', '../_base_/norms/bcn-ws.py']
pretrained = 'checkpoints/resnet50_bcn-ws_in1k.pth'
model = dict(
    backbone=dict(
        conv_cfg=_base_.conv_cfg,
        norm_cfg=_base_.norm_cfg,
        norm_eval=False,
        init_cfg=dict(
            _delete_=True,
            type='PretrainedBackbone',
            checkpoint=pretrained,
            produced_by="convert the WS/BCN authors' released BCN+WS ResNet-50 "
            '(github.com/joe-siyuan-qiao/Batch-Channel-Normalization): python tools/convert_checkpoint.py '
            f'RELEASED.pth {pretrained} --to mmdet --from authors; or pretrain it (90 epochs): '
            'python tools/train.py configs/imagenet/resnet50_bcn-ws_in1k.py && '
            'python tools/convert_checkpoint.py work_dirs/resnet50_bcn-ws_in1k/epoch_90.pth '
            f'{pretrained} --to mmdet')),
    neck=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg),
    roi_head=dict(
        bbox_head=dict(
            type='Shared4Conv1FCBBoxHead',
            conv_out_channels=256,
            conv_cfg=_base_.conv_cfg,
            norm_cfg=_base_.norm_cfg),
        mask_head=dict(conv_cfg=_base_.conv_cfg, norm_cfg=_base_.norm_cfg)))
