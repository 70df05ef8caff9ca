# Micro-batch variant of deeplabv3_r101-d16_bn_voc12aug-513x513.py: 2 images per GPU.
# BN at 1-2 images per GPU: plain BN (no SyncBN) in the backbone, so every BN normalizes over
# the 2 images of its own GPU -- the micro-batch regime the WS/BCN paper is about.
# Batch size 1 / ASPP image pooling (1x1 map): a BN there would see 1-2 values per channel (and
# fail outright at 1 image per GPU), and mmseg's ASPPHead builds the image-pool ConvModule from
# the head's single norm_cfg, so the whole ASPP head uses GN (32 groups): per image, works at
# batch size 1. The backbone BN at batch 1 still sees >= 33x33 pixels per channel at crop 513.
# Launch on 8 GPUs (8 x 2 = the paper's 16 images per iteration at lr 0.007); on fewer GPUs
# add --auto-scale-lr (lr x total batch / 16) or keep 16 with more images per GPU.
_base_ = './deeplabv3_r101-d16_bn_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

train_dataloader = dict(batch_size=2)

model = dict(
    backbone=dict(norm_cfg=dict(type='BN', requires_grad=True)),
    decode_head=dict(norm_cfg=dict(type='GN', num_groups=32, requires_grad=True)))
