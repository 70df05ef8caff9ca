"""normdense.config_check: unknown layer types and missing data paths, found without building anything."""
import glob
import os.path as osp

import pytest
from mmengine.config import Config

from normdense import jobs
from normdense.config_check import ConfigError, check_data_paths, check_model_types, unknown_types

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DET = osp.join(ROOT, 'configs/mask_rcnn_r50_fpn_bcn_ws.py')
SEG = osp.join(ROOT, 'configs/deeplabv3/deeplabv3_r50-d8_gn-ws_voc12aug-513x513.py')
CONFIGS = sorted(p for p in glob.glob(osp.join(ROOT, 'configs', '**', '*.py'), recursive=True)
                 if not {'_base_', 'deploy'} & set(osp.relpath(p, ROOT).split(osp.sep)))  # deploy/: mmdeploy's


def test_configs_found():
    assert len(CONFIGS) > 100


@pytest.mark.parametrize('path', CONFIGS, ids=lambda p: osp.relpath(p, osp.join(ROOT, 'configs')))
def test_every_shipped_config_passes(path):
    cfg = Config.fromfile(path)  # (the time is Config parsing; the check itself takes about 1 ms)
    assert unknown_types(cfg.model, jobs.codebase_of(cfg)) == []


@pytest.mark.parametrize('key, value, where, suggestion', [
    ('backbone.norm_cfg', 'BNC', 'model.backbone.norm_cfg.type', "'BCN'"),
    ('backbone.conv_cfg', 'WSconv2d', 'model.backbone.conv_cfg.type', "'WSConv2d'"),
    ('roi_head.mask_head.norm_cfg', 'GNPM', 'model.roi_head.mask_head.norm_cfg.type', "'GNPN'"),
    ('roi_head.bbox_head.loss_cls', 'CrossEntropyLos', 'model.roi_head.bbox_head.loss_cls.type',
     "'CrossEntropyLoss'"),
    ('train_cfg.rcnn.assigner', 'MaxIOUAssigner', 'model.train_cfg.rcnn.assigner.type', "'MaxIoUAssigner'"),
    ('backbone.init_cfg', 'PretrainedBackbon', 'model.backbone.init_cfg.type', "'PretrainedBackbone'"),
])
def test_typos_are_one_line_with_path_and_closest_names(key, value, where, suggestion):
    cfg = Config.fromfile(DET)
    node = cfg.model
    for k in key.split('.'):
        node = node[k]
    node['type'] = value
    with pytest.raises(ConfigError) as e:
        check_model_types(cfg, 'mmdet')
    msg = str(e.value)
    assert '\n' not in msg and f"'{value}'" in msg and where in msg and suggestion in msg


def test_registry_named_in_the_message():
    cfg = Config.fromfile(DET)
    cfg.model.train_cfg.rcnn.sampler.type = 'RandomSamplr'
    with pytest.raises(ConfigError, match="TASK_UTILS.*'RandomSampler'"):
        check_model_types(cfg, 'mmdet')
    cfg = Config.fromfile(SEG)
    cfg.model.decode_head.norm_cfg.type = 'GNN'
    with pytest.raises(ConfigError, match=r"model\.decode_head\.norm_cfg\.type: not in mmseg's MODELS"):
        check_model_types(cfg, 'mmseg')


def test_a_name_of_another_registry_is_not_a_norm_layer():
    cfg = Config.fromfile(DET)
    cfg.model.backbone.norm_cfg.type = 'MaxIoUAssigner'  # a TASK_UTILS name: mmcv's build_norm_layer fails
    with pytest.raises(ConfigError, match='norm_cfg'):
        check_model_types(cfg, 'mmdet')


def test_data_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's relative data_root must not exist
    cfg = Config.fromfile(SEG)
    with pytest.raises(ConfigError, match=r'data/VOCdevkit/VOC2012 \(from train_dataloader\.dataset\.datasets\[0\]'
                                          r'\.data_root\).*docs/data\.md'):
        check_data_paths(cfg, 'train')
    root = tmp_path / 'VOC2012'
    for d in ('JPEGImages', 'SegmentationClass', 'SegmentationClassAug', 'ImageSets/Segmentation'):
        (root / d).mkdir(parents=True)
    for sub in cfg.train_dataloader.dataset.datasets:
        sub.data_root = str(root)
    cfg.val_dataloader.dataset.data_root = cfg.test_dataloader.dataset.data_root = str(root)
    with pytest.raises(ConfigError, match=r'ImageSets/Segmentation/train\.txt \(from .*\.ann_file\)'):
        check_data_paths(cfg, 'train')
    for name in ('train', 'aug', 'val'):
        (root / 'ImageSets/Segmentation' / f'{name}.txt').write_text('x\n')
    check_data_paths(cfg, 'train')
    (root / 'SegmentationClassAug').rmdir()
    with pytest.raises(ConfigError, match=r'SegmentationClassAug \(from .*datasets\[1\]\.data_prefix\.seg_map_path'):
        check_data_paths(cfg, 'train')
    check_data_paths(cfg, 'test')  # the test split does not read the aug folder
