__version__ = '0.1.0'

# Supported ranges of the core stack: setup.py turns them into install_requires and
# normdense/utils_version.py checks them at import. The lower ends are the ones `make test-min` runs the
# layer tests on (requirements/min.txt); the exact stack `make install` pins is requirements/constraints.txt.
torch_minimum_version = '2.1.0'
mmengine_minimum_version = '0.10.3'
mmengine_maximum_version = '1.0.0'
mmcv_minimum_version = '2.0.0'
mmcv_maximum_version = '2.2.0'
