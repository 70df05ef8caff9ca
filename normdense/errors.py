"""The errors a user can fix, as one line naming the fix, and the wrapper every packaged tool runs in.

A tool (``tools/*.py``, ``python -m normdense.tools NAME``) turns a known error into one line on stderr
and exit status 1; ``--debug`` (or ``NORMDENSE_DEBUG=1``) shows the traceback instead. Anything else keeps
its traceback: it is a bug to report, not a setup problem.
"""
import os
import sys
from typing import Callable, Optional

from .version import mmcv_maximum_version, mmcv_minimum_version

DEBUG_ENV = 'NORMDENSE_DEBUG'

MMCV_RANGE = f'mmcv>={mmcv_minimum_version},<{mmcv_maximum_version}'
MMCV_REBUILD = ('rebuild it for this torch: pip install --no-cache-dir --no-binary mmcv --no-build-isolation '
                f'"{MMCV_RANGE}" (or FORCE=1 make install), or use OpenMMLab\'s prebuilt wheel for your '
                f'torch/CUDA: pip install -U openmim && mim install "{MMCV_RANGE}"')
MMCV_NO_OPS = (f'mmcv-lite or an mmcv built without ops: pip install -U openmim && mim install "{MMCV_RANGE}" '
               '(prebuilt with ops)')
PKG_RESOURCES_FIX = ("mmengine needs pkg_resources to resolve 'mmdet::' / 'mmseg::' base configs, and "
                     'setuptools >= 81 no longer has it: pip install "setuptools<81"')


class UserFixable:
    """Mixed into the exception classes whose message names the fix (a missing codebase, a config or data
    problem, a checkpoint that does not fit): the tools print them as one line. A mixin here, so this module
    imports none of the modules that define them."""


class SetupError(UserFixable, ImportError):
    """Something the environment lacks (one-line message naming the install that fixes it)."""


class ExportError(UserFixable, RuntimeError):
    """A model that cannot be exported as it is (training mode, an output that is not a tensor)."""


class MmcvOpsError(SetupError):
    """mmcv's compiled ops are missing (mmcv-lite) or do not load/run under the installed torch."""


def mmcv_ops_problem(exc: BaseException) -> Optional[str]:
    """Why ``exc`` means mmcv's ops are unusable (one line with the fix), or None if it is not that."""
    text = str(exc)
    if isinstance(exc, ImportError):
        if exc.name == 'mmcv._ext' or "No module named 'mmcv._ext'" in text:
            return f"mmcv's compiled ops are missing ({MMCV_NO_OPS})"
        if 'mmcv' in text and ('_ext' in text or 'undefined symbol' in text):
            return f"mmcv's compiled ops do not load under torch {_torch_version()} (built for another torch): " \
                   f'{MMCV_REBUILD}'
    if isinstance(exc, RuntimeError) and '_impl: implementation for device' in text:
        # the ops' device registry is empty when mmcv._ext was built against another torch's ABI
        return f"mmcv's ops do not run under torch {_torch_version()} ({text.splitlines()[0]}): {MMCV_REBUILD}"
    return None


def _torch_version() -> str:
    torch = sys.modules.get('torch')
    return getattr(torch, '__version__', '?')


def _is_missing(exc: BaseException, module: str) -> bool:
    return isinstance(exc, ModuleNotFoundError) and (exc.name == module or f"No module named '{module}'" in str(exc))


def known_error(exc: BaseException) -> Optional[str]:
    """The one-line message of an error a user can fix, or None for anything else."""
    seen = set()
    while exc is not None and id(exc) not in seen:  # the cause of a re-raised error counts too
        seen.add(id(exc))
        if _is_missing(exc, 'pkg_resources'):
            return PKG_RESOURCES_FIX
        problem = mmcv_ops_problem(exc)
        if problem:
            return problem
        if isinstance(exc, (UserFixable, FileNotFoundError)):
            return ' '.join(str(exc).split('\n'))  # missing codebase / data / checkpoint / config, unknown type
        exc = exc.__cause__ or exc.__context__
    return None


def debug_requested(argv=()) -> bool:
    return '--debug' in argv or os.environ.get(DEBUG_ENV, '') not in ('', '0')


def run_tool(main: Callable, prog: Optional[str] = None):
    """Run a tool's ``main()``: a known error becomes one line on stderr and exit status 1 (``--debug`` or
    ``NORMDENSE_DEBUG=1``: the traceback). Returns the exit status for ``sys.exit``."""
    debug = debug_requested(sys.argv[1:])
    if debug:  # for the tool's own one-line handlers too
        os.environ[DEBUG_ENV] = '1'
    sys.argv = [a for a in sys.argv if a != '--debug']
    prog = prog or os.path.basename(sys.argv[0])
    try:
        result = main()
    except Exception as e:  # noqa: BLE001  (SystemExit and KeyboardInterrupt pass through)
        message = None if debug else known_error(e)
        if message is None:
            raise
        print(f'{prog}: error: {message} (--debug for the traceback)', file=sys.stderr)
        return 1
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
