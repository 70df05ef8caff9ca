"""normdense installs into a user's own OpenMMLab environment: its wheel's metadata holds ranges (no pins)
and neither torch nor mmcv (the user's, built for their torch/CUDA), pip's resolver keeps the user's torch /
mmcv / mmcv-lite / mmengine / mmdet, and the wheel carries the configs (with their READMEs), tools
(``normdense/.mim``) and the license. Offline: the wheel is built here, resolution uses ``--no-index``
against an environment of stand-in distributions; the slow test runs the self-check in a throwaway venv
with the local torch 2.13.0 wheel over the pinned stack's mmcv (built for torch 2.12.1)."""
import email
import glob
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
    assert {f'mmengine<{nd_version.mmengine_maximum_version},>={nd_version.mmengine_minimum_version}',
            'setuptools<81'} <= core  # mmengine 0.10.x imports pkg_resources (gone in setuptools 81)
    # torch and mmcv are the user's (checked at import): pip must never install or replace them
    assert not [r for r in requires if r.startswith(('torch', 'mmcv'))]
    # the codebases are extras, never core requirements
    assert not [r for r in core if r.startswith(('mmdet', 'mmsegmentation', 'mmpretrain'))]
    assert set(_metadata(wheel).get_all('Provides-Extra')) >= {'det', 'seg', 'pretrain', 'deploy', 'all', 'tests'}


def _fake_distribution(site, name, version):
    """An installed distribution as pip sees it (dist-info with METADATA / INSTALLER / RECORD)."""
    info = site / f'{name}-{version}.dist-info'
    info.mkdir(parents=True)
    (info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
    (info / 'INSTALLER').write_text('pip\n')
    (info / 'RECORD').write_text('')


def _fake_wheel(folder, name, version):
    """A wheel with metadata only: enough for pip's resolver (--dry-run) to pick it offline."""
    info = f'{name}-{version}.dist-info'
    with zipfile.ZipFile(folder / f'{name}-{version}-py3-none-any.whl', 'w') as z:
        z.writestr(f'{info}/METADATA', f'Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n')
        z.writestr(f'{info}/WHEEL', 'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
        z.writestr(f'{info}/RECORD', '')


USER_ENVS = {
    # a GPU environment: another supported torch (with a local CUDA label), mmcv, mmengine, mmdet
    'gpu': {'torch': '2.5.1+cu121', 'mmcv': '2.1.0', 'mmengine': '0.10.4', 'mmdet': '3.2.0',
            'numpy': '1.26.4', 'pillow': '10.4.0', 'pycocotools': '2.0.7', 'setuptools': '69.5.1'},
    # issue 28's: torch 2.13.0 (CPU), mmcv-lite (no mmcv distribution), mmseg, and the setuptools that
    # `pip install torch==2.13.0` brought (84: no pkg_resources)
    'lite': {'torch': '2.13.0+cpu', 'mmcv-lite': '2.1.0', 'mmengine': '0.10.4', 'mmsegmentation': '1.2.2',
             'ftfy': '6.3.1', 'regex': '2024.11.6', 'numpy': '2.4.6', 'pillow': '12.0.0', 'setuptools': '84.0.0'},
}


@pytest.mark.parametrize('env,extra', [('gpu', 'det'), ('gpu', None), ('lite', 'seg')])
def test_pip_keeps_the_users_torch_mmcv_mmengine_mmdet(wheel, tmp_path, env, extra):
    venv = tmp_path / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
    (site,) = venv.glob('lib/python3*/site-packages')
    for name, version in USER_ENVS[env].items():
        _fake_distribution(site, name, version)
    _fake_wheel(wheel.parent, 'setuptools', '80.9.0')  # the last setuptools with pkg_resources
    report = tmp_path / 'report.json'
    requirement = f'normdense[{extra}]' if extra else 'normdense'
    # pip >= 22.3 resolves for another interpreter with --python
    result = subprocess.run(
        [sys.executable, '-m', 'pip', '--python', str(venv / 'bin' / 'python'), 'install', '--dry-run',
         '--no-index', '--find-links', str(wheel.parent), '--report', str(report), requirement],
        env=_offline_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    installs = {item['metadata']['name']: item['metadata']['version'] for item in json.loads(report.read_text())['install']}
    # nothing of the user's stack; setuptools only where it has no pkg_resources for mmengine
    expected = {'normdense': nd_version.__version__}
    if parse_version(USER_ENVS[env]['setuptools']) >= parse_version('81'):
        expected['setuptools'] = '80.9.0'
    assert installs == expected


def test_wheel_carries_configs_tools_and_license(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / 'site')
    for folder in ('configs', 'tools'):
        shipped = {osp.relpath(osp.join(d, f), osp.join(ROOT, folder)) for d, _, fs in os.walk(osp.join(ROOT, folder))
                   for f in fs if f.endswith(('.py', '.sh', '.md'))}
        assert shipped and {f'normdense/.mim/{folder}/{f}' for f in shipped} <= names
    # the configs' READMEs (the README's config table links them)
    families = ('mask_rcnn', 'faster_rcnn', 'deeplabv3', 'imagenet')
    assert {f'normdense/.mim/configs/{c}/README.md' for c in families} <= names
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


# a torch-only machine (the GPU machines of scripts/gpu_check.sh): mmcv, mmengine and the codebases absent
_BLOCK_MM = """import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('mmcv', 'mmengine', 'mmdet', 'mmseg', 'mmpretrain'):
            raise ModuleNotFoundError(f'No module named {name!r}', name=name.split('.')[0])
sys.meta_path.insert(0, _Block())
"""


def test_layers_only_mode_imports_the_layers_with_torch_alone(tmp_path):
    (tmp_path / 'sitecustomize.py').write_text(_BLOCK_MM)
    code = ('import sys, torch, normdense; from normdense.layers import IterNorm, BatchChannelNorm2d; '
            'from normdense.deploy.fuse import fuse; import normdense.kernels; '
            'BatchChannelNorm2d(8, 2, mode="batch")(torch.randn(2, 8, 3, 3)).sum().backward(); '
            'print(normdense.LAYERS_ONLY, sorted(m for m in sys.modules if m.split(".")[0] in ("mmcv", "mmengine")))')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    env.pop('NORMDENSE_LAYERS_ONLY', None)
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and 'mmengine' in proc.stderr  # without the switch: the version check
    env['NORMDENSE_LAYERS_ONLY'] = '1'
    proc = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == 'True []', proc.stdout
    with pytest.raises(ImportError, match='torch>='):  # torch is still checked
        check_core_versions(dict(torch='2.0.1'), names=('torch', ))
    check_core_versions(dict(torch='2.12.1'), names=('torch', ))  # mmcv/mmengine not asked for


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


def _local_wheel(pattern, env_var):
    """A wheel this machine kind holds (the local torch CPU wheel, pip's local index files); ``env_var``
    overrides. No download: None when absent."""
    found = [os.environ[env_var]] if os.environ.get(env_var) else []
    return (found + sorted(glob.glob(f'/opt/wheels/{pattern}')) + sorted(glob.glob(f'/opt/pypi/files/{pattern}'))
            + [None])[0]


# what the throwaway venv does not take from the pinned stack (distribution and top-level names)
_NOT_LINKED = {'torch', 'torchgen', 'functorch', 'torchvision', 'triton', 'setuptools', 'pkg_resources',
               '_distutils_hack', 'distutils', 'normdense', 'pip'}


@pytest.fixture(scope='module')
def user_venv(wheel, tmp_path_factory):
    """A throwaway venv as issue 28's user had: torch 2.13.0 (the local CPU wheel) over the pinned stack,
    whose mmcv was built for torch 2.12.1 by `make install` (the wheel pip caches: taken from the cache when
    there), and normdense from its wheel (not editable). Returns (python, PYTHONPATH of normdense)."""
    import mmcv
    import torch
    whl = _local_wheel('torch-2.13.0*cp311*.whl', 'NORMDENSE_TORCH_WHEEL')
    if whl is None or sys.version_info[:2] != (3, 11):
        pytest.skip('needs the local torch 2.13.0 CPU wheel for Python 3.11 (/opt/wheels or NORMDENSE_TORCH_WHEEL)')
    assert not torch.__version__.startswith('2.13'), 'the pinned stack must run another torch than 2.13'
    tmp = tmp_path_factory.mktemp('user_venv')
    venv = tmp / 'venv'
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True)
    (site,) = venv.glob('lib/python3*/site-packages')
    # the pinned stack's other packages, linked into a folder the venv puts on its path (after its own
    # site-packages): not its torch, its setuptools (pkg_resources) or its editable normdense
    pinned, stack = osp.dirname(osp.dirname(mmcv.__file__)), tmp / 'stack'
    stack.mkdir()
    for name in os.listdir(pinned):
        if not name.split('-')[0].split('.')[0].lower() in _NOT_LINKED and not name.startswith('__editable__'):
            (stack / name).symlink_to(osp.join(pinned, name))
    (site / 'pinned_stack.pth').write_text(f'{stack}\n')
    cached = subprocess.run([sys.executable, '-m', 'pip', 'cache', 'list', 'mmcv', '--format=abspath'],
                            env=_offline_env(), capture_output=True, text=True).stdout.split()
    wheels = [whl] + [w for w in cached if osp.basename(w).startswith(f'mmcv-{mmcv.__version__}-')][:1]
    subprocess.run([sys.executable, '-m', 'pip', '--python', str(venv / 'bin' / 'python'), 'install', '-q',
                    '--no-deps', '--no-index', '--no-compile', *wheels], check=True, env=_offline_env())
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp / 'normdense_site')
    return venv / 'bin' / 'python', str(tmp / 'normdense_site')


@pytest.mark.slow
def test_pip_installs_normdense_seg_into_that_venv_without_touching_its_stack(user_venv, wheel, tmp_path):
    python, _ = user_venv
    _fake_wheel(wheel.parent, 'setuptools', '80.9.0')  # the venv has no setuptools: normdense asks for <81
    report = tmp_path / 'report.json'
    result = subprocess.run([sys.executable, '-m', 'pip', '--python', str(python), 'install', '--dry-run', '--no-index',
                             '--find-links', str(wheel.parent), '--report', str(report), 'normdense[seg]'],
                            env=_offline_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    installs = {i['metadata']['name']: i['metadata']['version'] for i in json.loads(report.read_text())['install']}
    assert installs == {'normdense': nd_version.__version__, 'setuptools': '80.9.0'}


@pytest.mark.slow
def test_self_check_fails_in_one_line_on_mmcv_built_for_another_torch(user_venv, tmp_path):
    """mmcv's ops import there but do not run (issue 28): the self-check, run from outside the checkout,
    must say so in one line; so must make install's check before it keeps an mmcv."""
    python, site = user_venv
    env = dict(_offline_env(), PYTHONPATH=site)
    out = subprocess.run([str(python), '-c', 'import torch, normdense; print(torch.__version__, '
                          'normdense.__file__); from normdense.self_check import main; raise SystemExit(main())'],
                         cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    first = out.stdout.splitlines()[0] if out.stdout else ''
    assert first.startswith('2.13.0') and site in first, out.stdout + out.stderr
    assert 'mmcv             2.1.0 (ops: CPU' in out.stdout, out.stdout  # imports: only running an op tells
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith('normdense self-check FAILED: ') and '--no-cache-dir --no-binary mmcv' in line
    assert 'mim install' in line
    # make install's check before it keeps an mmcv (pip's cached wheel is this build): rejected here, kept
    # under the torch it was built for
    mmcv_ok = ('eval "$(sed -n \'/^mmcv_ok() {/,/^}/p\' scripts/install.sh)"; PY="$1"; mmcv_ok')
    for py, expected in ((python, 1), (sys.executable, 0)):
        check = subprocess.run(['bash', '-c', mmcv_ok, 'mmcv_ok', str(py)], cwd=ROOT, env=_offline_env(),
                               capture_output=True, text=True, timeout=300)
        assert check.returncode == expected, (py, check.stdout, check.stderr)


@pytest.mark.slow
def test_setuptools_without_pkg_resources_stops_the_tool_in_one_line(user_venv, tmp_path):
    """The same venv after `pip install torch==2.13.0` brought setuptools >= 81 (this machine's local
    setuptools wheel, shadowing the pinned stack's): a `mmseg::` config stops with the fix, in one line."""
    python, site = user_venv
    setuptools = _local_wheel('setuptools-8[1-9]*.whl', 'NORMDENSE_SETUPTOOLS_WHEEL')
    if setuptools is None:
        pytest.skip('needs a local setuptools >= 81 wheel (/opt/pypi/files or NORMDENSE_SETUPTOOLS_WHEEL)')
    target = tmp_path / 'setuptools'
    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', '--no-compile',
                    '--target', str(target), setuptools], check=True, env=_offline_env())
    env = dict(_offline_env(), PYTHONPATH=os.pathsep.join([site, str(target)]))
    out = subprocess.run([str(python), '-c', 'import pkg_resources'], env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "No module named 'pkg_resources'" in out.stderr, out.stderr
    config = 'configs/demo/deeplabv3_r18-d8_bcn-ws_toy-voc.py'
    out = subprocess.run([str(python), '-m', 'normdense.tools', 'train', config], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith('train.py: error: ') and 'pip install "setuptools<81"' in line
