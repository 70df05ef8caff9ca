#!/usr/bin/env bash
# `make demo`: toy COCO -> Mask R-CNN with BCN+WS at 2 images per batch on CPU -> COCO AP -> a PNG of
# predictions. Everything runs through the user-facing tools (tools/train.py, tools/test.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV:-.venv}/bin/python"
CONFIG=configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py
WORK=${WORK:-work_dirs/demo_det}
START=$(date +%s)
stamp() { echo "==> [demo $(( $(date +%s) - START ))s] $*"; }

if [ ! -f data/toy_coco/annotations/instances_val.json ]; then
  stamp "generating toy COCO (data/toy_coco)"
  "$PY" tools/make_toy_coco.py
fi
stamp "training $CONFIG (log: $WORK/)"
"$PY" tools/train.py "$CONFIG" --work-dir "$WORK" "$@"
CKPT="$WORK/$(cat "$WORK/last_checkpoint" | xargs basename)"
stamp "evaluating $CKPT on toy val (COCO AP via mmdet's CocoMetric)"
"$PY" tools/test.py "$CONFIG" "$CKPT" --work-dir "$WORK" --show-dir vis --out "$WORK/predictions.pkl" 2>&1 \
  | tee "$WORK/test_output.log" | grep -E "Average (Precision|Recall)|Evaluating|_mAP_copypaste|Epoch\(test\).*coco" || true
VIS=$(ls -td "$WORK"/*/vis 2>/dev/null | head -1)
"$PY" tools/tile_images.py "$WORK/predictions.png" $(ls "$VIS"/*.jpg | head -6) --cols 3 >/dev/null
stamp "done: predictions drawn by mmdet's DetLocalVisualizer in $WORK/predictions.png (left: ground truth, right: prediction)"
grep -E "coco/bbox_mAP: |Epoch\(test\)" "$WORK/test_output.log" | tail -1
