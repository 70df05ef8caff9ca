from setuptools import find_packages, setup


def read_version():
    with open('normdense/version.py') as f:
        scope = {}
        exec(f.read(), scope)
    return scope['__version__']


def read_requirements(path):
    with open(path) as f:
        return [line.split('#')[0].strip() for line in f if line.split('#')[0].strip()]


setup(
    name='normdense',
    version=read_version(),
    description='Micro-batch-friendly normalization layers (WS, BCN, GN+PN, IterNorm, Unitization, '
                'EquiNorm) for OpenMMLab detection and segmentation',
    long_description=open('README.md').read(),
    long_description_content_type='text/markdown',
    packages=find_packages(exclude=('tests', 'tests.*', 'configs', 'tools', 'benchmarks')),
    python_requires='>=3.9',
    # mmcv must be built with its ops (see scripts/install.sh); it is not listed so that pip never tries
    # to build it without MMCV_WITH_OPS.
    install_requires=read_requirements('requirements/torch.txt') + read_requirements('requirements/runtime.txt'),
    extras_require={'tests': read_requirements('requirements/tests.txt')},
    license='Apache-2.0',
)
