# Micro-batch variant of deeplabv3_r101-d16_gn_voc12aug-513x513.py: 2 images per GPU.
# GN does not depend on the batch: this differs from the paper-batch config only in how the 16
# images are spread over GPUs. Batch size 1 works (see the base config).
# Launch on 8 GPUs (8 x 2 = the paper's 16 images per iteration at lr 0.007); on fewer GPUs
# add --auto-scale-lr (lr x total batch / 16) or keep 16 with more images per GPU.
_base_ = './deeplabv3_r101-d16_gn_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

train_dataloader = dict(batch_size=2)
