# GN baseline: GroupNorm(32) with plain convs (mmdet's configs/gn/ placement plus the 4conv1fc box head).
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
conv_cfg = None
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
