# The WS/BCN paper's longer schedule: 24 epochs with lr steps at epochs 20 and 23 (mmdet gn+ws configs).
_base_ = './mask-rcnn_r101_fpn_iternorm_2x_coco.py'
param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type='MultiStepLR', begin=0, end=24, by_epoch=True, milestones=[20, 23], gamma=0.1)
]
