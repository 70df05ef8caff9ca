# What both deploy configs here share: mmdeploy's configs/_base_/onnx_config.py and backends/onnxruntime.py
# (opset 11, static input shape), with optimize=False: mmdeploy's ONNX optimizer is a TorchScript extension
# that its PyPI wheel lacks (True only logs "Can not optimize model").
onnx_config = dict(
    type='onnx',
    export_params=True,
    keep_initializers_as_inputs=False,
    opset_version=11,
    save_file='end2end.onnx',
    input_names=['input'],
    output_names=['output'],
    input_shape=None,
    optimize=False)
backend_config = dict(type='onnxruntime')
