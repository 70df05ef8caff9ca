"""Two CPU processes (gloo, launched by torchrun through tools/train.py --launcher pytorch) train a small
Mask R-CNN with estimate-mode BCN: the estimates must be identical on both ranks, and must differ when
the moment synchronization is switched off (so the check can fail)."""
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

from normdense.data.writers import write_coco

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')


def run_two_ranks(tmp_path, data_root, sync):
    work = tmp_path / f'work_sync{int(sync)}'
    cfg = tmp_path / f'dist_sync{int(sync)}.py'
    cfg.write_text(f"""_base_ = {DEMO!r}
custom_imports = dict(imports=['normdense', 'tests.toy_runner'], allow_failed_imports=False)
data_root = {data_root!r}
model = dict(backbone=dict(init_cfg=None, norm_cfg=dict(sync_stats={sync})), neck=dict(norm_cfg=dict(sync_stats={sync})),
             roi_head=dict(bbox_head=dict(norm_cfg=dict(sync_stats={sync})), mask_head=dict(norm_cfg=dict(sync_stats={sync}))))
train_dataloader = dict(batch_size=1, dataset=dict(data_root=data_root))
val_dataloader = None
val_evaluator = None
val_cfg = None
test_dataloader = None
test_evaluator = None
test_cfg = None
train_cfg = dict(max_iters=3, val_interval=100)
default_hooks = dict(checkpoint=dict(interval=100))
custom_hooks = [dict(type='BCNRateHook'), dict(type='DumpBCNEstimatesHook')]
""")
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=2', '--master_port=29517',
                          osp.join(ROOT, 'tools', 'train.py'), str(cfg), '--launcher', 'pytorch', '--work-dir', str(work)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return [torch.load(work / f'bcn_estimates_rank{r}.pth') for r in (0, 1)]


@pytest.mark.slow
def test_estimates_identical_across_ranks(tmp_path):
    data_root = str(tmp_path / 'toy_coco') + '/'
    write_coco(data_root, num_train=8, num_val=2, size=96)
    rank0, rank1 = run_two_ranks(tmp_path, data_root, sync=True)
    assert rank0.keys() == rank1.keys() and len(rank0) == 36
    for name in rank0:
        for a, b in zip(rank0[name], rank1[name]):
            assert torch.equal(a, b), name
    moved = [n for n in rank0 if not torch.equal(rank0[n][0], torch.zeros_like(rank0[n][0]))]
    assert len(moved) == len(rank0)
    # control: without synchronization each rank estimates from its own images
    rank0, rank1 = run_two_ranks(tmp_path, data_root, sync=False)
    assert any(not torch.equal(rank0[n][0], rank1[n][0]) for n in rank0)
