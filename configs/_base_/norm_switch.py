# The norm switch for any mmdet / mmseg / mmpretrain config (normdense/norm_switch.py, docs/any_model.md):
#   _base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', 'normdense::_base_/norm_switch.py']
#   normdense_norm = 'bcn-ws'   # bn, gn, gn-ws, bcn-ws, gn-pn, iternorm, unitization
# (set it in the inheriting config; this file leaves it unset so a dict can be given) or dict(norm='bcn-ws', num_groups=32, exclude=['roi_head.mask_head'], convert=False).
# A config whose other bases set custom_imports too (normdense's own configs) cannot inherit this file
# (mmengine refuses duplicate keys among bases): write runner_type = 'NormSwitchRunner' there instead.
# NormSwitchRunner applies it when the runner is built, so the codebases' own tools/train.py and
# tools/test.py (which build cfg.runner_type) and `mim train` take such a config unchanged.
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
runner_type = 'NormSwitchRunner'
