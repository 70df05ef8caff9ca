"""Run normdense's tools and find its configs from an installed package (no clone needed).

A wheel (``pip install normdense``) carries ``configs/`` and ``tools/`` as ``normdense/.mim/`` (mmdet's
layout, see setup.py); a source checkout (``pip install -e .``) has them beside the package::

    python -m normdense.tools                                   # list the tools and where the configs are
    python -m normdense.tools train configs/demo/mask-rcnn_r18_fpn_bcn-ws_toy-coco.py --work-dir runs/x
    python -m normdense.tools test  mask_rcnn/mask-rcnn_r50_fpn_gn-ws_2x_coco.py CKPT.pth
    python -m normdense.tools train mmdet::retinanet/retinanet_r50_fpn_1x_coco.py --norm bcn-ws

A config argument that is not an existing file is looked up in normdense's configs (with or without the
leading ``configs/``); the tool then runs exactly as ``python tools/<tool>.py`` would: the known errors
(normdense.errors) as one line on stderr, exit status 1; ``--debug`` or ``NORMDENSE_DEBUG=1`` for the traceback.
"""
import os
import os.path as osp
import runpy
import sys
from typing import List, Optional

_PACKAGE_DIR = osp.dirname(osp.abspath(__file__))


def package_root() -> str:
    """The folder holding ``configs/`` and ``tools/``: ``normdense/.mim`` in a wheel install, else the
    source checkout the package was imported from."""
    checkout = osp.dirname(_PACKAGE_DIR)
    if osp.isfile(osp.join(checkout, 'setup.py')):  # editable / source: the checkout, not a stale .mim copy
        candidates = (checkout, osp.join(_PACKAGE_DIR, '.mim'))
    else:
        candidates = (osp.join(_PACKAGE_DIR, '.mim'),)
    for root in candidates:
        if osp.isdir(osp.join(root, 'configs')) and osp.isdir(osp.join(root, 'tools')):
            return root
    raise FileNotFoundError(f'normdense at {_PACKAGE_DIR} has no configs/ and tools/ (neither in .mim/ nor '
                            'beside it): reinstall it with pip install normdense or from a git clone')


def configs_dir() -> str:
    return osp.join(package_root(), 'configs')


def list_tools() -> List[str]:
    tools = osp.join(package_root(), 'tools')
    return sorted(osp.splitext(f)[0] for f in os.listdir(tools) if f.endswith('.py') and not f.startswith('_'))


def resolve_config(arg: str) -> Optional[str]:
    """``arg`` if it is a file or a packaged name (``mmdet::...``: the tool resolves it), else the config of that
    name in normdense's configs, else None."""
    if osp.isfile(arg) or '::' in arg:
        return arg
    rel = arg[len('configs/'):] if arg.startswith('configs/') else arg
    candidate = osp.join(configs_dir(), rel)
    return candidate if osp.isfile(candidate) else None


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ('-h', '--help'):
        print(__doc__.strip())
        print(f'\ntools: {" ".join(list_tools())}\nconfigs: {configs_dir()}')
        return
    name, args = argv[0], argv[1:]
    if name not in list_tools():
        raise SystemExit(f'normdense has no tool {name!r}; tools: {" ".join(list_tools())}')
    # the first argument that names one of our configs (tools take the config first)
    if args and not args[0].startswith('-') and args[0].endswith('.py') and '::' not in args[0]:
        args[0] = resolve_config(args[0]) or args[0]
    path = osp.join(package_root(), 'tools', name + '.py')
    sys.argv = [path] + args
    runpy.run_path(path, run_name='__main__')


if __name__ == '__main__':
    main()
