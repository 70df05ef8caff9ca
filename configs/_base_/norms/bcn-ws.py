# BCN+WS for micro-batch training (WS/BCN paper Sec. 7, Algorithm 1): the batch stage normalizes with
# running estimates updated at rate r = the current learning rate, which BCNRateHook delivers.
# A config that sets its own custom_hooks must keep BCNRateHook (without it training stops at the first
# iteration with an error rather than silently never updating the estimates).
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
conv_cfg = dict(type='WSConv2d')
norm_cfg = dict(type='BCN', num_groups=32, mode='estimate')
custom_hooks = [dict(type='BCNRateHook')]
