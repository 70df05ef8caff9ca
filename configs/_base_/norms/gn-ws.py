# GN+WS: GroupNorm(32) after Weight-Standardized convs (WS/BCN paper Sec. 4; formula='paper', Eq. 7).
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
conv_cfg = dict(type='WSConv2d')
norm_cfg = dict(type='GN', num_groups=32, requires_grad=True)
