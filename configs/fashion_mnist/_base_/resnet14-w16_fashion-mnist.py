# Fashion-MNIST (Xiao et al. 2017: 70,000 real 28x28 grey product photographs, 10 classes) through
# mmpretrain's FashionMNIST dataset, with the structure of configs/imagenet (mmpretrain's ImageClassifier:
# ResNet backbone, global average pooling, linear head; SGD with momentum 0.9 and weight decay 1e-4, the
# WS/BCN paper's ImageNet recipe) scaled to 28x28 inputs: ResNet-14 of width 16 = mmpretrain's ResNet with
# BasicBlocks, its plain stem (7x7 stride-2 conv, 3x3 max-pool; 16 channels, 1 input channel) and the
# first three stages of ResNet-18 (2 blocks each; 16, 32, 64 channels; 7x7, 4x4, 2x2 maps), 13 convs + fc.
# The 2x2 maps of the last stage keep 4 values per channel at batch 1 (BatchNorm and IterNorm need >= 2).
#
# The norm comes from the norm switch (runner_type NormSwitchRunner, normdense_norm in each config:
# docs/any_model.md) with 8 groups (2-8 channels per group, as the paper's 32 groups at full width).
# The schedule (one pass over the training subset, lr scaled with the batch) is set by
# ./fashion-mnist_1xb{1,2,32}.py. Data: the four idx files (train-images-idx3-ubyte, ... extracted, as
# mmpretrain reads them) under data_root; benchmarks/norm_comparison_fmnist.py extracts Debian's
# dataset-fashion-mnist package, or mmpretrain downloads them with download=True (configs/fashion_mnist/README.md).
_base_ = ['mmpretrain::_base_/models/resnet18.py', 'mmpretrain::_base_/default_runtime.py']
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
runner_type = 'NormSwitchRunner'

data_root = 'data/fashion_mnist'
test_images = 10000  # the whole test set

model = dict(
    backbone=dict(depth=18, num_stages=3, out_indices=(2, ), strides=(1, 2, 2), dilations=(1, 1, 1),
                  in_channels=1, stem_channels=16, base_channels=16),
    head=dict(in_channels=64, num_classes=10, topk=(1, )))
# Fashion-MNIST's pixel mean and std (0.2860, 0.3530 of 255) over the 60,000 training images
data_preprocessor = dict(num_classes=10, mean=[72.94], std=[90.02], to_rgb=False)
train_pipeline = [dict(type='RandomFlip', prob=0.5, direction='horizontal'), dict(type='PackInputs')]
test_pipeline = [dict(type='PackInputs')]
train_dataloader = dict(
    batch_size=32, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(type='FashionMNIST', data_prefix=data_root, test_mode=False,
                 download=False, pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=500, num_workers=0, persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='FashionMNIST', data_prefix=data_root, test_mode=True,
                 download=False, indices=test_images, pipeline=test_pipeline))
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_dataloader = val_dataloader
test_evaluator = val_evaluator

# one pass over the 60,000 training images at batch 32 (the per-batch files train on a subset)
max_iters = 60000 // 32
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict()
test_cfg = dict()
optim_wrapper = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9, weight_decay=1e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=max_iters // 10),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=max_iters // 10, end=max_iters, eta_min=0.0)]
default_hooks = dict(
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=1),
    logger=dict(type='LoggerHook', interval=max(1, max_iters // 10)))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
