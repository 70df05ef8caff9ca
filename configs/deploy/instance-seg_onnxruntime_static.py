# mmdeploy 1.3.1 deploy config: an mmdet instance-segmentation model (Mask R-CNN, e.g.
# configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py) to ONNX for ONNX Runtime, static shape. The same
# settings as mmdeploy's own configs/mmdet/instance-seg/instance-seg_onnxruntime_static.py and its bases
# (_base_/base_instance-seg_static.py, _base_/base_static.py, _base_/onnx_config.py, backends/onnxruntime.py;
# in mmdeploy's repository, not in its wheel); the ONNX and backend settings are _base_/onnxruntime_static.py
# (optimize=False there: the PyPI wheel lacks mmdeploy's ONNX optimizer).
# The graph holds the whole detector: backbone, FPN, RPN with box decoding and NMS (ONNX NonMaxSuppression),
# RoI heads (ONNX RoiAlign) and the mask head; outputs dets (N, keep_top_k, 5: x1, y1, x2, y2, score),
# labels (N, keep_top_k) and masks (N, keep_top_k, 28, 28) before pasting into the image
# (export_postprocess_mask=False). Every operator is a standard ONNX one: plain onnxruntime runs it.
# input_shape=None: the image as the test pipeline resizes and pads it (the demo: 160x160); [W, H] to fix.
# Run it with tools/mmdeploy_torch2onnx.py (README.md here).
_base_ = ['./_base_/onnxruntime_static.py']
onnx_config = dict(output_names=['dets', 'labels', 'masks'])
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
