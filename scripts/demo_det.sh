#!/usr/bin/env bash
# `make demo`: the whole used-by workflow on toy data, through the tools users run:
#   toy ImageNet -> pretrain a half-width ResNet-18 with WS + BCN (tools/train.py, mmpretrain)
#   -> convert it into an mmdet backbone (tools/convert_checkpoint.py, cached in checkpoints/)
#   -> fine-tune Mask R-CNN with BCN+WS at 2 images per batch on toy COCO (tools/train.py, mmdet)
#   -> COCO AP on toy val (tools/test.py, mmdet's CocoMetric) -> a PNG of predictions.
# The pretraining is skipped when the converted backbone already exists (delete it to redo it).
# Threads: an already set OMP_NUM_THREADS wins; otherwise torch uses one per core.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
CONFIG=configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py
PRE_CONFIG=configs/demo/resnet18-w32_bcn-ws_toy-imagenet.py
PRE_WORK=work_dirs/resnet18-w32_bcn-ws_toy-imagenet
BACKBONE=checkpoints/resnet18-w32_bcn-ws_toy.pth   # what $CONFIG's init_cfg loads
WORK=${WORK:-work_dirs/demo_det}
START=$(date +%s)
stamp() { echo "==> [demo $(( $(date +%s) - START ))s] $*"; }

# 1000 train images (the tool's default is 256): at 1400-2000 iterations the demo over-fits 256 (README).
NUM_TRAIN=1000
if [ ! -f data/toy_coco/annotations/instances_val.json ] \
   || [ "$(find data/toy_coco/train -name '*.jpg' 2>/dev/null | wc -l)" -ne "$NUM_TRAIN" ]; then
  stamp "generating toy COCO (data/toy_coco, $NUM_TRAIN train images)"
  "$PY" tools/make_toy_coco.py --num-train "$NUM_TRAIN"
fi
if [ -e "$BACKBONE" ]; then
  stamp "pretrained backbone $BACKBONE found: skipping the pretraining (delete it to redo it)"
else
  if [ ! -f data/toy_imagenet/meta/val.txt ]; then
    stamp "generating toy ImageNet (data/toy_imagenet)"
    "$PY" tools/make_toy_imagenet.py
  fi
  stamp "pretraining $PRE_CONFIG (log: $PRE_WORK/)"
  "$PY" tools/train.py "$PRE_CONFIG" --work-dir "$PRE_WORK"
  PRE_CKPT="$PRE_WORK/$(xargs basename < "$PRE_WORK/last_checkpoint")"
  stamp "converting $PRE_CKPT into the mmdet backbone $BACKBONE"
  "$PY" tools/convert_checkpoint.py "$PRE_CKPT" "$BACKBONE" --to mmdet
fi
stamp "fine-tuning $CONFIG (log: $WORK/)"
# tools/test.py evaluates the checkpoint next, so training runs without its validation loop (the same
# 64 images, ~25 s; mmengine builds no ValLoop when these are None). Extra arguments go to tools/train.py.
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK" --cfg-options val_cfg=None val_dataloader=None val_evaluator=None "$@"
CKPT="$WORK/$(xargs basename < "$WORK/last_checkpoint")"
stamp "evaluating $CKPT on toy val (COCO AP via mmdet's CocoMetric)"
"$PY" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK" --show-dir vis --out "$WORK/predictions.pkl" 2>&1 \
  | tee "$WORK/test_output.log" | grep -E "Average (Precision|Recall)|Evaluating|_mAP_copypaste|Epoch\(test\).*coco" || true
VIS=$(ls -td "$WORK"/*/vis 2>/dev/null | head -1)
"$PY" tools/tile_images.py "$WORK/predictions.png" $(ls "$VIS"/*.jpg | head -6) --cols 3 >/dev/null
stamp "done: predictions drawn by mmdet's DetLocalVisualizer in $WORK/predictions.png (left: ground truth, right: prediction)"
grep -E "coco/bbox_mAP: |Epoch\(test\)" "$WORK/test_output.log" | tail -1
