"""benchmarks/detector_step.py on the CPU at a tiny size: the code path the GPU run takes (issue 52)."""
import importlib.util
import json
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec('torchvision') is None, reason='needs torchvision')

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'benchmarks'))


@pytest.mark.slow
def test_tiny_cpu_run_converts_every_variant_and_writes_json_and_table(tmp_path):
    import detector_step
    out = tmp_path / 'd.json'
    result = detector_step.main(['--device', 'cpu', '--size', '64', '96', '--steps', '1', '--warmup', '1', '--no-amp',
                                 '--rois', '8', '--out', str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result['rows']
    assert list(rows) == list(detector_step.VARIANTS)
    expect = {'frozen BN': 'FrozenBatchNorm2d', 'GN+WS': 'GroupNorm', 'BCN+WS estimate': 'BatchChannelNorm2d',
              'Unitization': 'Unitization2d', 'IterNorm': 'IterNorm'}
    total = sum(rows['frozen BN']['norms'].values())
    assert total > 60  # backbone, FPN, RPN head, box and mask heads
    for v, kind in expect.items():
        assert rows[v]['norms'] == {kind: total}, (v, rows[v]['norms'])  # every norm converted, none left as BN
        assert rows[v]['ms'] > 0 and rows[v]['x_frozen BN'] == pytest.approx(rows[v]['ms'] / rows['frozen BN']['ms'])
    assert rows['GN+WS']['ws_convs'] == rows['BCN+WS estimate']['ws_convs'] > 60 and rows['Unitization']['ws_convs'] == 0
    assert rows['BCN+WS estimate']['backends'] == {'aten': total}  # CPU tensors: ATen (Triton on a GPU)
    assert set(result['targets_met']) == {'BCN+WS estimate', 'Unitization'}
    table = (tmp_path / 'd.md').read_text()
    assert table.count('\n| ') == 1 + len(rows) and 'target <= 1.1' in table


def test_refusals_are_one_line(capsys):
    import detector_step
    with pytest.raises(SystemExit) as e:
        detector_step.main(['--variants', 'frozen BN,BN+WS'])
    assert e.value.code == 2 and "unknown variants ['BN+WS']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match='no GPU .*--device cpu runs the code path'):
            detector_step.main(['--device', 'cuda'])
