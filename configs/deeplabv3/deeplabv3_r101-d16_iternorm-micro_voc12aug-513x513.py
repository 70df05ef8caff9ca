# Micro-batch variant of deeplabv3_r101-d16_iternorm_voc12aug-513x513.py: 2 images per GPU.
# IterNorm whitens over the 2 images (x all pixels) of its own GPU. The ASPP head is GN as in
# the base config, so batch size 1 works; the backbone's IterNorms see >= 1089 observations
# per 64-channel group per image at crop 513.
# Launch on 8 GPUs (8 x 2 = the paper's 16 images per iteration at lr 0.007); on fewer GPUs
# add --auto-scale-lr (lr x total batch / 16) or keep 16 with more images per GPU.
_base_ = './deeplabv3_r101-d16_iternorm_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

train_dataloader = dict(batch_size=2)
