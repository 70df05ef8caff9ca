"""Import the whole stack normdense runs on and print its versions (the last step of `make install`)."""
import importlib
import sys


def main():
    import torch
    import torchvision
    import mmcv
    from mmcv.ops import RoIAlign  # noqa: F401  (fails if mmcv was built without ops or against another torch)
    import mmengine
    import mmdet
    import mmseg
    import mmpretrain
    import pycocotools
    import normdense

    rows = [('python', sys.version.split()[0]), ('torch', torch.__version__),
            ('torchvision', torchvision.__version__), ('mmcv (with ops)', mmcv.__version__),
            ('mmengine', mmengine.__version__), ('mmdet', mmdet.__version__),
            ('mmseg', mmseg.__version__), ('mmpretrain', mmpretrain.__version__),
            ('pycocotools', getattr(pycocotools, '__version__', importlib.metadata.version('pycocotools'))),
            ('normdense', normdense.__version__)]
    print('normdense self-check: every package imports')
    for name, version in rows:
        print(f'  {name:<16} {version}')


if __name__ == '__main__':
    main()
