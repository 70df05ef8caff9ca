# mmdeploy 1.3.1 deploy config: an mmdet instance-segmentation model (Mask R-CNN, e.g.
# configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py) to ONNX for ONNX Runtime, static shape. The same
# settings as mmdeploy's own configs/mmdet/instance-seg/instance-seg_onnxruntime_static.py and its bases
# (_base_/base_instance-seg_static.py, _base_/base_static.py, _base_/onnx_config.py, backends/onnxruntime.py;
# in mmdeploy's repository, not in its wheel), written out as one dict, except optimize=False (the PyPI
# wheel lacks the TorchScript extension of mmdeploy's ONNX optimizer: True only logs "Can not optimize model").
# The graph holds the whole detector: backbone, FPN, RPN with box decoding and NMS (ONNX NonMaxSuppression),
# RoI heads (ONNX RoiAlign) and the mask head; outputs dets (N, keep_top_k, 5: x1, y1, x2, y2, score),
# labels (N, keep_top_k) and masks (N, keep_top_k, 28, 28) before pasting into the image
# (export_postprocess_mask=False). Every operator is a standard ONNX one: plain onnxruntime runs it.
# input_shape=None: the image as the test pipeline resizes and pads it (the demo: 160x160); [W, H] to fix.
# Run it with tools/mmdeploy_torch2onnx.py (README.md here).
onnx_config = dict(
    type='onnx',
    export_params=True,
    keep_initializers_as_inputs=False,
    opset_version=11,
    save_file='end2end.onnx',
    input_names=['input'],
    output_names=['dets', 'labels', 'masks'],
    input_shape=None,
    optimize=False)
codebase_config = dict(
    type='mmdet',
    task='ObjectDetection',
    model_type='end2end',
    post_processing=dict(
        score_threshold=0.05,
        confidence_threshold=0.005,
        iou_threshold=0.5,
        max_output_boxes_per_class=200,
        pre_top_k=5000,
        keep_top_k=100,
        background_label_id=-1,
        export_postprocess_mask=False))
backend_config = dict(type='onnxruntime')
