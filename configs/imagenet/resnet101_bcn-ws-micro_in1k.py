# ResNet-101 (plain 7x7 stem, mmdet's ResNet), ImageNet-1k pretraining.
# BCN+WS, micro batch (Algorithm 1): BCN in mode='estimate' at 1 image per GPU with gradients
# accumulated over 64 iterations (the WS paper's micro-batch ImageNet setting: 4 GPUs x 1 image x 64 = 256
# images per update). BCNRateHook sets the estimates' update rate r to the current lr before every
# iteration, i.e. the estimates move on every 1-image forward.
# Convert the result for mmdet/mmseg: checkpoints/README.md
_base_ = ['./_base_/in1k_paper.py']
model = dict(
    backbone=dict(
        depth=101,
        conv_cfg=dict(type='WSConv2d'),
        norm_cfg=dict(type='BCN', num_groups=32, mode='estimate')))
train_dataloader = dict(batch_size=1)
optim_wrapper = dict(accumulative_counts=64)
# mmengine's auto_scale_lr counts GPUs x images per GPU, not the accumulation: 4 x 1 here
auto_scale_lr = dict(base_batch_size=4)
custom_hooks = [dict(type='BCNRateHook')]
