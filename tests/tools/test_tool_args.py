"""tools/train.py and tools/test.py take the codebases' own arguments with each codebase's meaning;
config and data errors are one line before anything is built; the slurm scripts."""
import os
import os.path as osp
import subprocess
import sys
import warnings

import pytest
from mmengine.config import Config

from normdense import jobs

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
DET_BOX = osp.join(ROOT, 'configs/faster_rcnn/faster-rcnn_r50_fpn_bcn-ws_1x_coco.py')
DET_MASK = osp.join(ROOT, 'configs/mask_rcnn_r50_fpn_bcn_ws.py')
SEG = osp.join(ROOT, 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py')

# The options (and positionals) each codebase's own tools define, as read from their sources:
# mmdetection v3.3.0 tools/{train,test}.py, mmsegmentation v1.2.2 tools/{train,test}.py,
# mmpretrain v1.2.0 tools/{train,test}.py (these scripts are not in the pip wheels).
MMDET_TRAIN = ['--work-dir', '--amp', '--auto-scale-lr', '--resume', '--cfg-options', '--launcher',
               '--local_rank', '--local-rank']
MMSEG_TRAIN = ['--work-dir', '--resume', '--amp', '--cfg-options', '--launcher', '--local_rank', '--local-rank']
MMPRETRAIN_TRAIN = ['--work-dir', '--resume', '--amp', '--no-validate', '--auto-scale-lr', '--no-pin-memory',
                    '--no-persistent-workers', '--cfg-options', '--launcher', '--local_rank', '--local-rank']
MMDET_TEST = ['--work-dir', '--out', '--show', '--show-dir', '--wait-time', '--cfg-options', '--launcher', '--tta',
              '--local_rank', '--local-rank']
MMSEG_TEST = ['--work-dir', '--out', '--show', '--show-dir', '--wait-time', '--cfg-options', '--launcher', '--tta',
              '--local_rank', '--local-rank']
MMPRETRAIN_TEST = ['--work-dir', '--out', '--out-item', '--cfg-options', '--amp', '--show-dir', '--show',
                   '--interval', '--wait-time', '--no-pin-memory', '--tta', '--launcher', '--local_rank',
                   '--local-rank']


def _options(parser):
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize('theirs', [MMDET_TRAIN, MMSEG_TRAIN, MMPRETRAIN_TRAIN])
def test_train_accepts_every_option(theirs):
    assert set(theirs) <= _options(jobs.train_arg_parser())


@pytest.mark.parametrize('theirs', [MMDET_TEST, MMSEG_TEST, MMPRETRAIN_TEST])
def test_test_accepts_every_option(theirs):
    assert set(theirs) <= _options(jobs.test_arg_parser())


def test_command_lines_parse_as_theirs():
    p = jobs.train_arg_parser()
    a = p.parse_args(['c.py', '--work-dir', 'w', '--amp', '--auto-scale-lr', '--resume', '--cfg-options', 'a=1',
                      'b.c=[1,2]', '--launcher', 'slurm', '--local-rank', '3', '--no-validate', '--no-pin-memory',
                      '--no-persistent-workers'])
    assert (a.config, a.work_dir, a.amp, a.auto_scale_lr, a.resume, a.launcher, a.local_rank) == \
        ('c.py', 'w', True, True, 'auto', 'slurm', 3)
    assert a.cfg_options == {'a': 1, 'b.c': [1, 2]} and a.no_validate and a.no_pin_memory
    assert p.parse_args(['c.py', '--resume', 'x.pth']).resume == 'x.pth'  # mmdet / mmpretrain: optional path
    assert p.parse_args(['c.py', '--local_rank', '1']).local_rank == 1
    t = jobs.test_arg_parser().parse_args(
        ['c.py', 'k.pth', '--out', 'o', '--out-item', 'metrics', '--show', '--show-dir', 'v', '--wait-time', '0.5',
         '--interval', '3', '--amp', '--no-pin-memory', '--tta', '--launcher', 'pytorch'])
    assert (t.checkpoint, t.out, t.out_item, t.show, t.show_dir, t.wait_time, t.interval, t.tta) == \
        ('k.pth', 'o', 'metrics', True, 'v', 0.5, 3, True)
    with pytest.raises(SystemExit):
        jobs.test_arg_parser().parse_args(['c.py', 'k.pth', '--out-item', 'other'])


def _ckpt(tmp_path):
    path = tmp_path / 'model.pth'
    path.write_bytes(b'')
    return str(path)


def test_out_is_a_directory_for_mmseg_and_a_pickle_elsewhere(tmp_path):
    import numpy as np
    import torch
    from mmengine.registry import DefaultScope
    from mmseg.registry import METRICS
    from mmseg.utils import register_all_modules
    cfg = Config.fromfile(SEG)
    jobs.apply_test_args(cfg, _ckpt(tmp_path), out=str(tmp_path / 'pngs'))
    assert cfg.test_evaluator.output_dir == str(tmp_path / 'pngs') and cfg.test_evaluator.keep_results
    pickled = jobs.apply_test_args(Config.fromfile(SEG), _ckpt(tmp_path), out='preds.pkl')
    assert 'output_dir' not in pickled.test_evaluator  # a .pkl name: raw predictions (the seg demo reads them)
    # mmseg's IoUMetric built from that config writes one label PNG per image there
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        metric = METRICS.build(cfg.test_evaluator)
    metric.dataset_meta = dict(classes=tuple('abcdef'))
    pred = torch.randint(0, 6, (1, 8, 8))
    metric.process({}, [dict(pred_sem_seg=dict(data=pred), gt_sem_seg=dict(data=pred), img_path='a/img_7.jpg')])
    from PIL import Image
    assert np.array_equal(np.asarray(Image.open(tmp_path / 'pngs' / 'img_7.png')), pred[0].numpy())

    det = Config.fromfile(DET_BOX)
    jobs.apply_test_args(det, _ckpt(tmp_path), out=str(tmp_path / 'p.pkl'))
    assert 'output_dir' not in det.test_evaluator
    with pytest.raises(ValueError, match='.pkl'):
        jobs.apply_test_args(Config.fromfile(DET_BOX), _ckpt(tmp_path), out=str(tmp_path / 'dir'))


def test_tta_mmdet_wraps_the_model(tmp_path):
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.registry import DefaultScope
    cfg = Config.fromfile(DET_BOX)
    detector = cfg.model.copy()
    with pytest.warns(UserWarning, match='DetTTAModel'):
        jobs.apply_tta(cfg, 'mmdet')
    assert cfg.model.type == 'DetTTAModel' and cfg.model.module == detector
    assert cfg.test_dataloader.dataset.pipeline[-1].type == 'TestTimeAug'
    # a config's own tta_model and tta_pipeline are used as they are
    cfg = Config.fromfile(DET_BOX)
    cfg.tta_model = dict(type='DetTTAModel', tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.6), max_per_img=50))
    cfg.tta_pipeline = [dict(type='LoadImageFromFile'),
                        dict(type='TestTimeAug', transforms=[[dict(type='PackDetInputs')]])]
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        jobs.apply_tta(cfg, 'mmdet')
    assert cfg.model.tta_cfg.max_per_img == 50 and cfg.test_dataloader.dataset.pipeline == cfg.tta_pipeline
    cfg.model.module.backbone.init_cfg = None
    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmdet'):
        model = MODELS.build(cfg.model)
    assert type(model).__name__ == 'DetTTAModel' and type(model.module).__name__ == 'FasterRCNN'


def test_tta_refused_where_the_codebase_would_crash():
    with pytest.raises(ValueError, match='masks'):  # mmdet's DetTTAModel asserts on mask predictions
        jobs.apply_tta(Config.fromfile(DET_MASK), 'mmdet')
    cfg = Config.fromfile(SEG)
    cfg.pop('tta_model', None)
    with pytest.raises(ValueError, match='tta_model'):  # mmseg has no default TTA model
        jobs.apply_tta(cfg, 'mmseg')


def run_tool(*args, cwd):
    return subprocess.run([sys.executable, osp.join(ROOT, 'tools', args[0]), *args[1:]], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize('tool', ['train.py', 'test.py'])
def test_missing_data_is_one_line_naming_the_path_and_the_guide(tool, tmp_path):
    args = [DET_MASK] + ([_ckpt(tmp_path)] if tool == 'test.py' else [])
    out = run_tool(tool, *args, cwd=tmp_path)  # no data/coco/ under tmp_path
    assert out.returncode != 0
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) <= 3, lines[:20]  # (was a 584-line log ending in a pycocotools traceback)
    assert 'data/coco/' in lines[-1] and 'docs/data.md' in lines[-1] and 'Traceback' not in out.stderr


def test_missing_backbone_is_one_line_naming_how_to_get_it(tmp_path):
    coco = tmp_path / 'data' / 'coco'  # the data check passes: the paths exist (their content is not read)
    for split in ('train2017', 'val2017'):
        (coco / split).mkdir(parents=True)
    (coco / 'annotations').mkdir()
    for split in ('train2017', 'val2017'):
        (coco / 'annotations' / f'instances_{split}.json').write_text('{}')
    out = run_tool('train.py', DET_MASK, cwd=tmp_path)  # no checkpoints/ under tmp_path
    assert out.returncode != 0 and 'Traceback' not in out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) <= 3, lines[:20]
    assert 'checkpoints/resnet50_bcn-ws_in1k.pth not found' in lines[-1] and '--from authors' in lines[-1]
    assert 'init_cfg=None' in lines[-1]


def test_layer_type_typo_is_one_line_from_the_tool(tmp_path):
    out = run_tool('train.py', DET_MASK, '--cfg-options', 'model.backbone.norm_cfg.type=BNC', cwd=tmp_path)
    assert out.returncode != 0 and 'Traceback' not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "'BNC'" in last and 'model.backbone.norm_cfg.type' in last and "'BCN'" in last


def test_no_validate_and_loader_switches():
    cfg = Config.fromfile(SEG)
    jobs.apply_loader_args(cfg, no_validate=True, no_pin_memory=True, no_persistent_workers=True)
    assert cfg.val_cfg is None and cfg.val_dataloader is None and cfg.val_evaluator is None
    assert cfg.train_dataloader.pin_memory is False and cfg.train_dataloader.persistent_workers is False
    assert jobs.loaders_used(cfg, 'train') == ['train_dataloader']


@pytest.mark.parametrize('script', ['slurm_train.sh', 'slurm_test.sh'])
def test_slurm_scripts(script, tmp_path):
    path = osp.join(ROOT, 'tools', script)
    assert subprocess.run(['bash', '-n', path]).returncode == 0
    # a stand-in srun records the command line the script hands to slurm
    fake = tmp_path / 'bin' / 'srun'
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_LOG"\n')
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f'{fake.parent}:{os.environ["PATH"]}', SRUN_LOG=str(tmp_path / 'log'),
               GPUS='16', SRUN_ARGS='--quotatype=auto --exclusive')
    fourth = 'work dir' if script == 'slurm_train.sh' else 'ck.pth'
    res = subprocess.run(['bash', path, 'gpu', 'job1', 'c.py', fourth, '--cfg-options', 'a=1'], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    argv = (tmp_path / 'log').read_text().splitlines()
    assert argv[:4] == ['-p', 'gpu', '--job-name=job1', '--gres=gpu:8'] and '--ntasks=16' in argv
    assert '--quotatype=auto' in argv and '--exclusive' in argv
    tool = argv.index('-u') + 1
    assert argv[tool] == osp.join(osp.dirname(path), script.replace('slurm_', '').replace('.sh', '.py'))
    tool_args = argv[tool + 1:]
    if script == 'slurm_train.sh':
        assert tool_args == ['c.py', '--work-dir=work dir', '--launcher=slurm', '--cfg-options', 'a=1']
        parsed = jobs.train_arg_parser().parse_args(tool_args)
    else:
        assert tool_args == ['c.py', 'ck.pth', '--launcher=slurm', '--cfg-options', 'a=1']
        parsed = jobs.test_arg_parser().parse_args(tool_args)
    assert parsed.launcher == 'slurm' and parsed.cfg_options == {'a': 1}
