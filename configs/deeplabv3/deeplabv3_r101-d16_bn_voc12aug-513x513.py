# DeepLabV3 R-101, output stride 16, BN baseline. WS/BCN paper Table 11 (paper figure, not
# reproduced here): 76.49 mIoU on VOC 2012 val.
# Everything comes from the paper base: SyncBN in the backbone and the ASPP head (statistics over
# all 16 images of an iteration), mmseg's ImageNet BN weights (open-mmlab://resnet101_v1c).
#
# Batch size 1 / ASPP image pooling (1x1 map): BN there normalizes over the images of the batch
# (SyncBN: over all GPUs), so it needs >= 2 images per batch; a single process with 1 image fails
# with "Expected more than 1 value per channel when training". For 1-2 images per GPU use
# deeplabv3_r101-d16_bn-micro_voc12aug-513x513.py (GN in the ASPP head).
_base_ = '../_base_/deeplabv3_voc12aug_paper.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
