# ImageNet-1k pretraining of a normdense ResNet with the WS/BCN paper's recipe (Sec. 8.1.3):
# SGD lr 0.1, momentum 0.9, weight decay 1e-4, 90 epochs, lr x0.1 after every 30 epochs, total batch 256
# as 4 GPUs x 64 images (the paper's BN/BCN runs: "256 for 4 GPUs ... without synchronized BN"; batch-mode
# statistics are per GPU). mmpretrain's own ResNet classifier, dataset and runtime bases are inherited
# through the `mmpretrain::` scope; each configs/imagenet/*.py sets the backbone's conv/norm cfgs.
# Other GPU counts: --auto-scale-lr scales lr by (GPUs x images per GPU) / 256.
_base_ = [
    'mmpretrain::_base_/models/resnet50.py',
    'mmpretrain::_base_/datasets/imagenet_bs32.py',
    'mmpretrain::_base_/schedules/imagenet_bs256.py',
    'mmpretrain::_base_/default_runtime.py',
]
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

train_dataloader = dict(batch_size=64)
val_dataloader = dict(batch_size=64)
test_dataloader = dict(batch_size=64)

optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9, weight_decay=1e-4))
param_scheduler = dict(type='MultiStepLR', by_epoch=True, milestones=[30, 60], gamma=0.1)
train_cfg = dict(by_epoch=True, max_epochs=90, val_interval=1)
auto_scale_lr = dict(base_batch_size=256)
# epoch_90.pth is what tools/convert_checkpoint.py converts (see checkpoints/README.md)
default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1, max_keep_ckpts=3))
