"""normdense installs into a user's own OpenMMLab environment: its wheel's metadata holds ranges (no pins),
pip's resolver keeps another supported torch / mmcv / mmengine / mmdet, and the wheel carries the configs
and tools (``normdense/.mim``) and the license. Offline: the wheel is built here, resolution uses
``--no-index`` against an environment of stand-in distributions."""
import email
import json
import os
import os.path as osp
import shutil
import subprocess
import sys
import zipfile

import pytest

from normdense import version as nd_version
from normdense.compat import check_core_versions, parse_version, supported_range, version_problem
from normdense.self_check import NO_CUDA, cuda_ops_problem

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SOURCES = ('setup.py', 'pyproject.toml', 'MANIFEST.in', 'README.md', 'LICENSE', 'requirements', 'normdense',
           'configs', 'tools')


def _offline_env():
    """No pip configuration (this machine's index mirrors / find-links) and no index."""
    env = {k: v for k, v in os.environ.items() if not k.startswith('PIP_')}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX='1', PIP_DISABLE_PIP_VERSION_CHECK='1')
    return env


@pytest.fixture(scope='module')
def wheel(tmp_path_factory):
    """normdense's wheel, built from a copy of the sources (the checkout stays untouched)."""
    src = tmp_path_factory.mktemp('src')
    for name in SOURCES:
        path = osp.join(ROOT, name)
        if osp.isdir(path):
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns('__pycache__', '*.pyc', '.mim'))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp('wheel')
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w',
                    str(out), str(src)], check=True, env=_offline_env(), cwd=str(src))
    (whl,) = out.glob('normdense-*.whl')
    return whl


def _metadata(whl):
    with zipfile.ZipFile(whl) as z:
        (name,) = [n for n in z.namelist() if n.endswith('.dist-info/METADATA')]
        return email.message_from_bytes(z.read(name))


def test_no_dependency_is_pinned(wheel):
    requires = _metadata(wheel).get_all('Requires-Dist')
    assert requires
    pinned = [r for r in requires if '==' in r.split(';')[0]]  # after ';' is the marker (extra == "det")
    assert not pinned, f'pinned dependencies (pins belong in requirements/constraints.txt): {pinned}'
    core = {r.split(';')[0].replace(' ', '') for r in requires if 'extra ==' not in r}
    assert {f'torch>={nd_version.torch_minimum_version}',
            f'mmcv<{nd_version.mmcv_maximum_version},>={nd_version.mmcv_minimum_version}',
            f'mmengine<{nd_version.mmengine_maximum_version},>={nd_version.mmengine_minimum_version}'} <= core
    # the codebases are extras, never core requirements
    assert not [r for r in core if r.startswith(('mmdet', 'mmsegmentation', 'mmpretrain'))]
    assert set(_metadata(wheel).get_all('Provides-Extra')) >= {'det', 'seg', 'pretrain', 'all', 'tests'}


def _fake_distribution(site, name, version):
    """An installed distribution as pip sees it (dist-info with METADATA / INSTALLER / RECORD)."""
    info = site / f'{name}-{version}.dist-info'
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    (info / 'INSTALLER').write_text('pip\n')
    (info / 'RECORD').write_text('')


# a user's GPU environment: another supported torch (with a local CUDA label), mmcv, mmengine, mmdet
USER_ENV = {'torch': '2.5.1+cu121', 'mmcv': '2.1.0', 'mmengine': '0.10.4', 'mmdet': '3.2.0',
            'numpy': '1.26.4', 'pillow': '10.4.0', 'pycocotools': '2.0.7'}


@pytest.mark.parametrize('extra', ['det', None])
def test_pip_keeps_the_users_torch_mmcv_mmengine_mmdet(wheel, tmp_path, extra):
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
    (site,) = venv.glob('lib/python3*/site-packages')
    for name, version in USER_ENV.items():
        _fake_distribution(site, name, version)
    report = tmp_path / 'report.json'
    requirement = f'normdense[{extra}]' if extra else 'normdense'
    # pip >= 22.3 resolves for another interpreter with --python
    result = subprocess.run(
        [sys.executable, '-m', 'pip', '--python', str(venv / 'bin' / 'python'), 'install', '--dry-run',
         '--no-index', '--find-links', str(wheel.parent), '--report', str(report), requirement],
        env=_offline_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    installs = {item['metadata']['name']: item['metadata']['version'] for item in json.loads(report.read_text())['install']}
    assert installs == {'normdense': nd_version.__version__}


def test_wheel_carries_configs_tools_and_license(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / 'site')
    for folder in ('configs', 'tools'):
        shipped = {osp.relpath(osp.join(d, f), osp.join(ROOT, folder)) for d, _, fs in os.walk(osp.join(ROOT, folder))
                   for f in fs if f.endswith(('.py', '.sh'))}
        assert shipped and {f'normdense/.mim/{folder}/{f}' for f in shipped} <= names
    (license_file,) = [n for n in names if n.endswith('.dist-info/LICENSE')]
    assert 'Apache License' in zipfile.ZipFile(wheel).read(license_file).decode()
    assert _metadata(wheel)['License'] == 'Apache-2.0'
    # an installed (not editable) normdense finds its configs and tools by itself
    code = ('import normdense.tools as t; print(t.package_root()); '
            'print(t.resolve_config("configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py")); print(t.list_tools())')
    out = subprocess.run([sys.executable, '-c', code], cwd=str(tmp_path), capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(tmp_path / 'site')))
    assert out.returncode == 0, out.stderr
    root, config, tools = out.stdout.splitlines()
    assert root == str(tmp_path / 'site' / 'normdense' / '.mim')
    assert config == osp.join(root, 'configs', 'demo', 'mask-rcnn_r18_fpn_bcn-ws_toy-coco.py')
    assert {'train', 'test', 'convert_checkpoint'} <= set(eval(tools))


def test_version_ranges_parse_like_pip():
    assert parse_version('2.1.2+cu121') == parse_version('2.1.2') > parse_version('2.1.0')
    assert parse_version('2.0.0rc4') < parse_version('2.0.0') < parse_version('2.0.1')
    assert parse_version('2.10.0') > parse_version('2.9.9')
    assert parse_version('1.0') == parse_version('1.0.0')


def test_import_time_version_check_names_the_range_and_the_fix():
    lo, hi = nd_version.mmcv_minimum_version, nd_version.mmcv_maximum_version
    ok = dict(torch='2.12.1+cpu', mmengine='0.10.7', mmcv='2.1.0')
    check_core_versions(ok)
    for bad in (hi, '2.2.1', '1.7.2', '2.0.0rc4'):
        with pytest.raises(ImportError) as e:
            check_core_versions(dict(ok, mmcv=bad))
        msg = str(e.value)
        assert '\n' not in msg and f'mmcv>={lo},<{hi}' in msg and f'found mmcv {bad}' in msg
        assert 'mim install' in msg
    assert version_problem('mmcv', lo) is None and version_problem('mmcv', '2.1.0') is None
    assert 'torch>=2.1.0' in version_problem('torch', '2.0.1')
    assert version_problem('torch', '2.1.2+cu121') is None
    assert 'not installed' in version_problem('mmengine', None)
    assert supported_range('mmengine') == f'mmengine>={nd_version.mmengine_minimum_version},<1.0.0'
    with pytest.raises(ImportError, match=r'mmengine>=.*found mmengine 1\.0\.0'):
        check_core_versions(dict(ok, mmengine='1.0.0'))


def test_self_check_fails_when_a_gpu_meets_cpu_only_mmcv_ops():
    # CPU machine (here, CI): CPU-only ops are right, whatever CUDA torch was built with
    assert cuda_ops_problem(False, '13.0', NO_CUDA) is None
    assert cuda_ops_problem(False, None, NO_CUDA) is None
    # a GPU with CPU-only ops: RoIAlign/NMS would fail on it
    msg = cuda_ops_problem(True, '12.1', NO_CUDA)
    assert msg and '\n' not in msg and 'without CUDA' in msg and 'mim install mmcv==2.1.0' in msg
    assert cuda_ops_problem(True, '12.1', '12.1') is None
    assert cuda_ops_problem(True, '12.1', '12.4') is None  # minor versions are compatible
    assert 'compiled for CUDA 11.8' in cuda_ops_problem(True, '12.1', '11.8')
