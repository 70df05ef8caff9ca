"""normdense's package metadata (PEP 517 through setuptools, see pyproject.toml).

Dependencies are the *ranges* normdense supports (read from normdense/version.py); torch and mmcv are
checked at import, never installed (see install_requires). The exact stack that `make install` and CI use
is pinned in requirements/constraints.txt, not here. mmdet, mmsegmentation and
mmpretrain are extras: `pip install "normdense[det]"` / `[seg]` / `[pretrain]` / `[all]`.
"""
import os
import os.path as osp
import shutil
import sys

from setuptools import find_packages, setup

HERE = osp.dirname(osp.abspath(__file__))


def read_version_module():
    scope = {}
    with open(osp.join(HERE, 'normdense', 'version.py')) as f:
        exec(f.read(), scope)
    return scope


def read_requirements(path):
    with open(osp.join(HERE, path)) as f:
        return [line.split('#')[0].strip() for line in f if line.split('#')[0].strip()]


def install_requires(v):
    # torch and mmcv are the user's, as for mmdet: mmcv's ops must be built for that torch and CUDA
    # (OpenMMLab's prebuilt wheels: `mim install "mmcv>=2.0.0,<2.2.0"`), and pip would otherwise add an
    # mmcv beside mmcv-lite or reuse a cached wheel built for another torch. `import normdense` checks both
    # (normdense/compat.py). setuptools<81: mmengine 0.10.x imports pkg_resources (dropped in 81) to
    # resolve `mmdet::` / `mmseg::` base configs.
    return [f"mmengine>={v['mmengine_minimum_version']},<{v['mmengine_maximum_version']}",
            'setuptools<81',
            'numpy>=1.24',
            'Pillow']


EXTRAS = {
    # the lower ends are the minor releases whose APIs normdense's configs and tools use
    'det': ['mmdet>=3.2.0,<4.0.0', 'pycocotools'],
    # mmseg 1.2.x imports ftfy and regex without declaring them
    'seg': ['mmsegmentation>=1.2.0,<2.0.0', 'ftfy', 'regex'],
    'pretrain': ['mmpretrain>=1.2.0,<2.0.0'],
    # ONNX export and its ONNX Runtime check (tools/deploy.py --onnx); onnxscript: torch's dynamo exporter
    'deploy': read_requirements('requirements/deploy.txt'),
}
EXTRAS['all'] = sorted({req for reqs in EXTRAS.values() for req in reqs})
EXTRAS['tests'] = read_requirements('requirements/tests.txt')


def add_mim_extension():
    """Put configs/ and tools/ inside the package as normdense/.mim/ (mmdet's layout, read by `mim` and
    :mod:`normdense.tools`): copied for wheel/sdist builds. Editable installs leave the source tree
    alone; :func:`normdense.tools.package_root` then finds configs/ and tools/ beside the package."""
    if not any(cmd in sys.argv for cmd in ('bdist_wheel', 'sdist')):
        return
    mim_path = osp.join(HERE, 'normdense', '.mim')
    os.makedirs(mim_path, exist_ok=True)
    for name in ('configs', 'tools'):
        target = osp.join(mim_path, name)
        if osp.islink(target) or osp.isfile(target):
            os.remove(target)
        elif osp.isdir(target):
            shutil.rmtree(target)
        shutil.copytree(osp.join(HERE, name), target,
                        ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))


if __name__ == '__main__':
    add_mim_extension()
    version = read_version_module()
    setup(
        name='normdense',
        version=version['__version__'],
        description='Micro-batch-friendly normalization layers (WS, BCN, GN+PN, IterNorm, Unitization, '
                    'EquiNorm) for OpenMMLab detection and segmentation',
        long_description=open(osp.join(HERE, 'README.md')).read(),
        long_description_content_type='text/markdown',
        packages=find_packages(exclude=('tests', 'tests.*', 'configs', 'configs.*', 'tools', 'tools.*',
                                        'benchmarks', 'benchmarks.*')),
        include_package_data=True,
        package_data={'normdense': ['.mim/configs/**/*.py', '.mim/configs/**/*.md', '.mim/tools/*.py',
                                    '.mim/tools/*.sh']},
        python_requires='>=3.9',
        install_requires=install_requires(version),
        extras_require=EXTRAS,
        license='Apache-2.0',
        license_files=['LICENSE'],
        classifiers=['License :: OSI Approved :: Apache Software License',
                     'Programming Language :: Python :: 3',
                     'Topic :: Scientific/Engineering :: Artificial Intelligence'],
        zip_safe=False,
    )
