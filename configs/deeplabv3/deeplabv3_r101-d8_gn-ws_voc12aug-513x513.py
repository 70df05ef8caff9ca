# Output stride 8 variant of deeplabv3_r101-d16_gn-ws_voc12aug-513x513.py:
# layers 3 and 4 dilated by 2 and 4 (instead of layer 4 by 2) and the ASPP rates doubled to
# (12, 24, 36). Roughly 4x the compute of layers 3-4 and of the head at the same crop; the
# paper trains and tests at output stride 16. Batch-size-1 handling as in the stride-16 file.
_base_ = './deeplabv3_r101-d16_gn-ws_voc12aug-513x513.py'

custom_imports = dict(imports=['normdense'], allow_failed_imports=False)

model = dict(
    backbone=dict(strides=(1, 2, 1, 1), dilations=(1, 1, 2, 4)),
    decode_head=dict(dilations=(1, 12, 24, 36)))
