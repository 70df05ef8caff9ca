# mmdeploy 1.3.1 deploy config: an mmseg segmentor (e.g. configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py)
# to ONNX for ONNX Runtime, static shape. The same settings as mmdeploy's own
# configs/mmseg/segmentation_static.py + configs/_base_/backends/onnxruntime.py (they live in mmdeploy's
# repository, not in its wheel); the ONNX and backend settings are _base_/onnxruntime_static.py (optimize=False
# there). Kept: opset 11 (every normdense layer exports at it), with_argmax=True (the graph ends in the per-pixel
# label, (N, 1, H, W) int64; with_argmax=False leaves the logits (N, classes, H, W)).
# input_shape=None: the graph's input is the image as the model config's test pipeline resizes it (the
# demo: 80x80); set [W, H] (mmdeploy's order) to export at another size.
# Run it with tools/mmdeploy_torch2onnx.py (README.md here): under torch >= 2.9 mmdeploy needs the
# compatibility shim there (normdense/deploy/mmdeploy.py).
_base_ = ['./_base_/onnxruntime_static.py']
codebase_config = dict(type='mmseg', task='Segmentation', with_argmax=True)
