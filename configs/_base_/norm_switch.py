# The norm switch for any mmdet / mmseg / mmpretrain config (normdense/norm_switch.py, docs/any_model.md):
#   _base_ = ['mmdet::retinanet/retinanet_r50_fpn_1x_coco.py', '<normdense checkout>/configs/_base_/norm_switch.py']
#   normdense_norm = 'bcn-ws'   # bn, gn, gn-ws, bcn-ws, gn-pn, iternorm, unitization
# or normdense_norm = dict(norm='bcn-ws', num_groups=32, exclude=['roi_head.mask_head'], convert=False); this
# file leaves normdense_norm unset (mmengine cannot merge a dict over a None). In a wheel install the base is
# 'normdense::_base_/norm_switch.py'.
# A config whose other bases set custom_imports too (normdense's own configs) cannot inherit this file
# (mmengine refuses duplicate keys among bases): write runner_type = 'NormSwitchRunner' there instead.
# NormSwitchRunner applies the switch when the runner is built: mmdet's and mmpretrain's train.py / test.py
# and mmseg's train.py build cfg.runner_type; mmseg 1.2.2's test.py does not (use the model-type form,
# type='NormSwitched', there: docs/any_model.md).
custom_imports = dict(imports=['normdense'], allow_failed_imports=False)
runner_type = 'NormSwitchRunner'
