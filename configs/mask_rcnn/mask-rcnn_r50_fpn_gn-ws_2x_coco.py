# Mask R-CNN R-50-FPN, GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, FPN, 4conv1fc box head and mask head, as the WS/BCN paper (Sec. 8.3).
# 2x schedule; 8 GPUs x 2 images with lr 0.02 (use --auto-scale-lr for another total batch size).
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 that mmdet hosts and its configs/gn+ws/ use
# (open-mmlab://jhu/resnet50_gn_ws), read by mmengine's checkpoint loader (downloaded once, cached under
# $TORCH_HOME), weights-only. They were trained with mmcv's ConvWS, w / (std_unbiased + 1e-5), so
# formula='std_unbiased' (its function; float32 rounding differs by ~1 ulp), also in the FPN and heads, as mmdet.
# Its keys are those of mmdet's ResNet with GN (mmcv names GroupNorm 'gn': conv1, gn1, layerN.M.gn1-3,
# layerN.M.downsample.0/1) and load strictly; an ImageNet head ('fc.') is left out, logged.
# From our own pretraining (configs/imagenet/resnet50_gn-ws_in1k.py + tools/convert_checkpoint.py) instead:
#   --cfg-options model.backbone.init_cfg.checkpoint=<converted .pth> (its recorded WS formula is applied).
_base_ = ['mmdet::mask_rcnn/mask-rcnn_r50_fpn_2x_coco.py', '../_base_/norms/gn-ws.py']
conv_cfg = dict(type='WSConv2d', formula='std_unbiased')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
model = dict(
    backbone=dict(
        conv_cfg=conv_cfg,
        norm_cfg=norm_cfg,
        norm_eval=False,
        init_cfg=dict(
            _delete_=True,
            type='PretrainedBackbone',
            checkpoint='open-mmlab://jhu/resnet50_gn_ws',
            drop_prefixes=('fc.',))),
    neck=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg),
    roi_head=dict(
        bbox_head=dict(
            type='Shared4Conv1FCBBoxHead',
            conv_out_channels=256,
            conv_cfg=conv_cfg,
            norm_cfg=norm_cfg),
        mask_head=dict(conv_cfg=conv_cfg, norm_cfg=norm_cfg)))
