"""The norm switch on the codebases' own packaged configs (normdense/zoo.py): the architectures whose channel
counts 32 does not divide and UNet's nested upsample config train a step with every group norm; a sample of
the zoo's folders with every norm; one line per failure, never a traceback (benchmarks/zoo_sweep.py runs all)."""
import pytest

from normdense.norm_switch import CHOICES
from normdense.zoo import ZooResult, representative_configs, try_norm

GROUP_NORMS = ('gn', 'gn-ws', 'bcn-ws', 'gn-pn')
# channel counts 32 does not divide: 18 (HRNet), 432 (RegNetX-3.2GF), 16 (MobileNetV2, BiSeNetV2, SSDLite),
# 48 (DeepLabV3+'s bottleneck, Fast-SCNN), 35 (CGNet); UNet nests upsample_cfg, which UNet completes itself
ARCHITECTURES = [
    'mmseg::hrnet/fcn_hr18_4xb2-40k_cityscapes-512x1024.py',
    'mmdet::regnet/retinanet_regnetx-3.2GF_fpn_1x_coco.py',
    'mmseg::mobilenet_v2/mobilenet-v2-d8_deeplabv3plus_4xb2-80k_cityscapes-512x1024.py',
    'mmseg::deeplabv3plus/deeplabv3plus_r18-d8_4xb2-80k_cityscapes-512x1024.py',
    'mmseg::fastscnn/fast_scnn_8xb4-160k_cityscapes-512x1024.py',
    'mmseg::bisenetv2/bisenetv2_fcn_4xb4-160k_cityscapes-1024x1024.py',
    'mmseg::cgnet/cgnet_fcn_4xb4-60k_cityscapes-680x680.py',
    'mmdet::ssd/ssdlite_mobilenetv2-scratch_8xb24-600e_coco.py',
    'mmseg::ocrnet/ocrnet_hr18s_4xb2-160k_cityscapes-512x1024.py',
    'mmseg::unet/unet-s5-d16_fcn_4xb4-160k_cityscapes-512x1024.py',
]

pytestmark = pytest.mark.codebases


@pytest.mark.slow  # ~1 min on 2 cores: 40 builds and training steps
@pytest.mark.parametrize('config', ARCHITECTURES, ids=lambda c: c.split('/')[0].split('::')[1])
def test_architectures_take_every_group_norm(config):
    for norm in GROUP_NORMS:
        result = try_norm(config, norm)
        assert result.ok, f'{norm}: {result.line()}'


def test_classifier_head_norm_slot_takes_n_c():
    """mmpretrain's MobileNetV3 puts a BN1d in its head, which sees (N, C) features: the switch's BCN takes them
    (it stopped at 'expects (N, C, H, W) or (N, C, L) input, got shape (2, 1024)'); the sweep runs the head."""
    for norm in ('bcn-ws', 'gn-pn', 'unitization'):
        result = try_norm('mmpretrain::mobilenet_v3/mobilenet-v3-small_8xb128_in1k.py', norm)
        assert result.ok, f'{norm}: {result.line()}'


def test_a_failure_is_one_line_with_its_stage(tmp_path):
    broken = tmp_path / 'broken.py'
    broken.write_text("_base_ = ['mmseg::fcn/fcn_r18-d8_4xb2-80k_cityscapes-512x1024.py']\n"
                      "model = dict(backbone=dict(depth=19))\n")  # no ResNet-19
    result = try_norm(str(broken), 'gn')
    assert result.status == 'build fails' and '\n' not in result.line() and 'KeyError' in result.detail
    dataset_only = tmp_path / 'data.py'
    dataset_only.write_text("train_dataloader = dict(batch_size=2)\n")
    assert try_norm(str(dataset_only), 'gn').status == 'no model'
    assert ZooResult('x', 'gn', 'ok').line() == 'ok'


def test_representative_configs_one_per_folder():
    for codebase in ('mmdet', 'mmseg'):
        configs = representative_configs(codebase)
        folders = [f for f, _ in configs]
        assert len(folders) == len(set(folders)) > 40
        assert '_base_' not in folders
    assert representative_configs('mmseg', ['unet'])[0][1].endswith('.py')


@pytest.mark.slow  # ~1 min: a rotating sample of the zoo; the whole table is benchmarks/zoo_sweep.py
def test_zoo_sample_every_norm_ok_or_one_line():
    configs = representative_configs('mmdet', ['atss', 'fcos', 'yolox']) + \
        representative_configs('mmseg', ['encnet', 'erfnet', 'knet', 'pspnet', 'segformer'])
    assert len(configs) == 8
    # SegFormer: LayerNorm blocks left, its decode head gets permuted (non-contiguous) token features;
    # EncNet: a norm over (N, codes, C); KNet: a head whose __init__ skips its base's norm_cfg
    forced = dict(segformer='bcn-ws', encnet='bcn-ws', knet='gn')
    for i, (folder, path) in enumerate(configs):
        norm = forced.get(folder, CHOICES[1 + i % (len(CHOICES) - 1)])
        result = try_norm(path, norm)
        assert result.ok, f'{folder} {norm}: {result.line()}'
