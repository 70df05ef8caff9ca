"""normdense in a user's environment (issue 28): ``import normdense`` imports no codebase and works with
mmcv-lite; the packaged tools turn the known errors into one line on stderr (``--debug``: the traceback);
the self-check runs one of mmcv's ops. Each case is a fresh interpreter run from outside the checkout,
whose import system refuses what the environment lacks, as it would (ModuleNotFoundError): mmcv-lite is
mmcv without ``mmcv._ext``, setuptools >= 81 is one without ``pkg_resources``."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CODEBASES = ('mmdet', 'mmseg', 'mmpretrain')
DET_CONFIG = 'configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py'
SEG_CONFIG = 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py'

BLOCKER = '''
import sys
class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name in {blocked!r} or name.split('.')[0] in {blocked!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, _NotInstalled())
'''


def run_python(code, cwd, blocked=(), env=None):
    """``code`` in a fresh interpreter (this checkout's normdense first on the path, cwd outside it)."""
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    env.pop('NORMDENSE_DEBUG', None)
    return subprocess.run([sys.executable, '-c', BLOCKER.format(blocked=set(blocked)) + code], cwd=str(cwd),
                          capture_output=True, text=True, timeout=300, env=env)


def test_import_normdense_imports_no_codebase(tmp_path):
    out = run_python('''
import json, time
t = time.perf_counter()
import normdense
from mmengine.registry import MODELS
seconds = time.perf_counter() - t
print(json.dumps(dict(file=normdense.__file__, seconds=seconds, pn=MODELS.get('PNResNet').__module__,
                      codebases=sorted({m.split('.')[0] for m in sys.modules} & {'mmdet', 'mmseg', 'mmpretrain'}),
                      heavy=sorted({'mmengine.runner', 'mmengine.model', 'mmcv.ops'} & set(sys.modules)))))
''', tmp_path)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r['file'] == osp.join(ROOT, 'normdense', '__init__.py')
    assert r['codebases'] == [], f'import normdense imported {r["codebases"]} ({r["seconds"]:.1f} s)'
    assert r['pn'] == 'normdense.lazy'  # the stand-in, until a config builds it
    # nor mmengine's runner/model packages (torch.distributed: ~1 s): under 2 s on 2 cores, torch ~1.3 s of it
    assert r['heavy'] == [], r


def test_pn_resnet_registers_when_built(tmp_path):
    """The stand-in imports the backbone on the first build and leaves the real class registered."""
    out = run_python('''
import json
import normdense
from mmengine.registry import MODELS
from mmseg.registry import MODELS as SEG_MODELS
seg = SEG_MODELS.build(dict(type='PNResNetV1c', depth=18, base_channels=8, stem_channels=8,
                            norm_cfg=dict(type='GNPN', num_groups=4)))
print(json.dumps(dict(seg=type(seg).__name__, registered=MODELS.get('PNResNetV1c').__module__,
                      base=[c.__module__ for c in type(seg).__mro__ if c.__name__ == 'ResNet'])))
''', tmp_path)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r == dict(seg='PNResNetV1c', registered='normdense.models.backbones.pn_resnet',
                     base=['mmseg.models.backbones.resnet'])


def test_mmcv_lite_imports_normdense_and_names_the_fix_for_ops(tmp_path):
    """mmcv-lite (no mmcv._ext) with mmseg installed: the layers work; PNResNet, which needs mmseg's
    ResNet and so mmcv's ops, fails with one line naming mim."""
    out = run_python('''
import json
import normdense
from mmengine.registry import MODELS
from normdense.errors import MmcvOpsError
layer = MODELS.build(dict(type='BCN', num_features=8, num_groups=4))
try:
    MODELS.build(dict(type='PNResNet', depth=18))
    error = None
except MmcvOpsError as e:
    error = str(e)
print(json.dumps(dict(layer=type(layer).__name__, error=error)))
''', tmp_path, blocked={'mmcv._ext'})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.splitlines()[-1])
    assert r['layer'] == 'BatchChannelNorm2d'
    assert '\n' not in r['error'] and 'mim install "mmcv>=2.0.0,<2.2.0"' in r['error']


def _tool(tmp_path, args, blocked=(), debug=False):
    code = ('import runpy\nsys.argv = ["normdense.tools"] + %r\nrunpy.run_module("normdense.tools", '
            'run_name="__main__", alter_sys=True)\n' % (list(args) + (['--debug'] if debug else [])))
    return run_python(code, tmp_path, blocked)


# tool arguments, what the environment lacks, what the one line must say
KNOWN_ERRORS = {
    'missing codebase': (['train', DET_CONFIG], {'mmdet'}, "pip install 'normdense[det]'"),
    'missing data': (['train', DET_CONFIG, '--cfg-options', 'model.backbone.init_cfg=None',
                      'train_dataloader.dataset.data_root=/nonexistent/'], (), 'data not found: /nonexistent/'),
    'missing checkpoint': (['test', SEG_CONFIG, 'nonexistent.pth'], (), 'checkpoint not found: nonexistent.pth'),
    'unknown layer type': (['train', SEG_CONFIG, '--cfg-options', 'model.backbone.norm_cfg.type=BNC'], (),
                           "unknown type 'BNC'"),
    'mmcv without ops': (['train', SEG_CONFIG], {'mmcv._ext'}, 'mim install "mmcv>=2.0.0,<2.2.0"'),
    'no pkg_resources': (['train', SEG_CONFIG], {'pkg_resources'}, 'pip install "setuptools<81"'),
}


@pytest.mark.parametrize('case', list(KNOWN_ERRORS))
def test_packaged_tools_report_known_errors_in_one_line(tmp_path, case):
    args, blocked, fix = KNOWN_ERRORS[case]
    out = _tool(tmp_path, args, blocked)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-3000:]
    assert len(out.stderr.splitlines()) == 1, out.stderr[-3000:]
    assert fix in out.stderr and out.stderr.startswith(f'{args[0]}.py: error: ')


def test_debug_shows_the_traceback(tmp_path):
    args, blocked, fix = KNOWN_ERRORS['missing codebase']
    out = _tool(tmp_path, args, blocked, debug=True)
    assert out.returncode == 1 and 'Traceback (most recent call last)' in out.stderr and fix in out.stderr


def test_self_check_runs_an_op_and_fails_in_one_line_when_it_does_not_run(tmp_path):
    """An mmcv whose ops import but fail under this torch (the ABI of another torch: mmcv's device
    registry is empty) is what the self-check must catch: it runs nms."""
    broken = '''
import mmcv.ops, runpy
def nms(*args, **kwargs):
    raise RuntimeError('nms_impl: implementation for device cuda:0 not found.')
mmcv.ops.nms = nms
runpy.run_module('normdense.self_check', run_name='__main__')
'''
    out = run_python(broken, tmp_path)
    assert out.returncode == 1 and len(out.stderr.splitlines()) == 1, out.stdout + out.stderr
    assert 'nms_impl' in out.stderr and '--no-cache-dir --no-binary mmcv' in out.stderr
    assert 'mim install' in out.stderr
    ok = run_python("import runpy\nrunpy.run_module('normdense.self_check', run_name='__main__')", tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr  # the pinned stack


def test_ops_problem_messages_are_one_line():
    from normdense import errors, self_check
    msg = errors.mmcv_ops_problem(RuntimeError('nms_impl: implementation for device cuda:0 not found.\nmore'))
    assert msg and '\n' not in msg and 'another torch' not in msg and 'nms_impl' in msg
    msg = errors.mmcv_ops_problem(ImportError('/x/mmcv/_ext.cpython-311-x86_64-linux-gnu.so: undefined symbol: _Z'))
    assert 'built for another torch' in msg and 'mim install' in msg
    lite = ModuleNotFoundError("No module named 'mmcv._ext'", name='mmcv._ext')
    assert 'mmcv-lite' in errors.mmcv_ops_problem(lite)
    assert errors.mmcv_ops_problem(ValueError('nms_impl: implementation for device')) is None
    assert self_check.ops_run_problem(['cpu']) is None  # the pinned stack's ops run


def test_missing_torch_is_named_alone(tmp_path):
    """pip no longer installs torch with normdense: without it, the import names torch (mmengine and mmcv,
    which import torch themselves, are not reported as broken)."""
    out = run_python('import normdense', tmp_path, blocked={'torch'})
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 1 and last.startswith('ImportError: normdense needs torch>=2.1.0'), out.stderr


@pytest.mark.parametrize('blocked,rc', [({'mmcv._ext'}, 1), ({'mmcv._ext', 'mmdet', 'mmseg', 'mmpretrain'}, 0)])
def test_self_check_on_mmcv_lite(tmp_path, blocked, rc):
    """mmcv-lite is enough for normdense's layers (exit 0), not for mmdet / mmseg (one line naming mim)."""
    out = run_python("import runpy\nrunpy.run_module('normdense.self_check', run_name='__main__')", tmp_path, blocked)
    assert out.returncode == rc, out.stdout + out.stderr
    assert 'ops: none (mmcv-lite' in out.stdout
    if rc:
        (line,) = out.stderr.splitlines()
        assert "mmdet and mmseg need mmcv's compiled ops" in line and 'mim install' in line
