# Mask R-CNN R-50-FPN, GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4).
# Layers in the backbone, FPN, 4conv1fc box head and mask head, as the WS/BCN paper (Sec. 8.3).
# 2x schedule; 8 GPUs x 2 images with lr 0.02 (use --auto-scale-lr for another total batch size).
# Backbone: the WS authors' GN+WS ImageNet ResNet-50 that mmdet hosts (open-mmlab://jhu/resnet50_gn_ws, the weights of mmdet's
# configs/gn+ws/), loaded by mmengine's checkpoint loader (downloaded once, cached under $TORCH_HOME) and read
# weights-only. They were trained with mmcv's ConvWS, w / (std_unbiased + 1e-5): formula='std_unbiased' is
# bit-identical to it. The FPN and heads use the same formula, as mmdet's gn+ws configs (ConvWS everywhere).
# The file's keys are those of mmdet's ResNet with GN (conv1, gn1, layerN.M.conv1-3/gn1-3, layerN.M.downsample.0/1,
# mmcv names GroupNorm 'gn'), so PretrainedBackbone loads them strictly; an ImageNet classifier head ('fc.')
# is left out (logged). tests/test_loading.py checks this key for key on a checkpoint in that layout.
# From our own pretraining instead (configs/imagenet/resnet50_gn-ws_in1k.py, then tools/convert_checkpoint.py):
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
