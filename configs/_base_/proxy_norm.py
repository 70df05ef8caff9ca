# Shared pieces for Proxy Normalization (GN+PN) configs. Inherit it next to the model/schedule
# bases:  _base_ = [..., '../_base_/proxy_norm.py']
#
# * optim_wrapper.paramwise_cfg: among norm parameters only PN's beta~/gamma~ (`proxy_beta`,
#   `proxy_gamma`) keep weight decay; every GroupNorm subclass (GNPN's gamma/beta, plain GN) gets
#   norm_decay_mult=0; conv/linear weights keep the base decay. This is the PN paper's EfficientNet
#   recipe (App. A.1); its ResNet recipe decays all parameters (mmengine's default: drop this
#   paramwise_cfg or set norm_decay_mult=1.0). This dict is the one copy:
#   normdense.hooks.proxy_norm_check.proxy_norm_paramwise_cfg() reads it from this file (a config
#   cannot import normdense without becoming a lazy-import config that old-style configs cannot
#   inherit). The dict merges into the inheriting config's optim_wrapper (optimizer, clip_grad, ...
#   come from there).
# * custom_hooks: ProxyNormCheckHook fails fast if an activation is applied on top of a GNPN layer
#   (ConvModule without act_cfg=None, ResNet instead of PNResNet). A config that sets its own
#   custom_hooks list replaces this one: add the hook there too.
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

optim_wrapper = dict(
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        custom_keys={
            '.proxy_beta': dict(decay_mult=1.0),
            '.proxy_gamma': dict(decay_mult=1.0),
        }))

custom_hooks = [dict(type='ProxyNormCheckHook')]
