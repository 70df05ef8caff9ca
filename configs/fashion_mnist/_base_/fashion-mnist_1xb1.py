# 1 image(s) per batch, one pass over the first 6400 training images (6400 / 1 iterations; classes 9.3-10.9 %
# each), lr scaled with the batch as the WS/BCN paper adapts it for micro-batch training (the linear scaling
# rule: lr = 0.1 x 1 / 32), 10 % linear warm-up from lr / 10, cosine decay to 0. Estimate-mode BCN and
# Unitization update their estimates at r = lr (EstimateRateHook, added by the norm switch).
_base_ = ['./resnet14-w16_fashion-mnist.py']
batch = 1
train_images = 6400
max_iters = train_images // batch
lr = 0.1 * batch / 32
train_dataloader = dict(batch_size=batch, dataset=dict(indices=train_images))
optim_wrapper = dict(optimizer=dict(lr=lr))
train_cfg = dict(max_iters=max_iters, val_interval=max_iters)
param_scheduler = [
    dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=max_iters // 10),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=max_iters // 10, end=max_iters, eta_min=0.0)]
default_hooks = dict(
    checkpoint=dict(interval=max_iters),
    logger=dict(interval=max(1, max_iters // 10)))
