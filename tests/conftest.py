"""Tests marked ``cuda`` need a GPU: without one they are reported as skipped ("needs CUDA: not run"),
never as passed, so ``pytest -ra`` lists every one of them. Tests marked ``mmengine`` are reported likewise
("needs mmengine: not installed") where it does not import, e.g. on a GPU machine with torch and triton only
(``NORMDENSE_LAYERS_ONLY=1``, scripts/gpu_check.sh).

``make test`` runs the suite in pytest-xdist workers (``-n 2 --dist loadgroup``, docs/testing.md). Each worker is
its own process, so environment variables, the Triton interpreter's globals and the backend's state are per
worker; here: each worker takes its share of the cores (one intra-op thread each on 2 cores: two OpenMP teams
per core spin-wait for each other), the tests of a module with a module-scoped fixture (a built model, a wheel,
the sm_90 report) run in one worker so that it is built once, the slow tests are handed out first, and a test
that leaves the process-wide state changed (environment, backend state, torch's global switches, the working
directory) fails instead of passing it on to whichever test that worker runs next.

Without a GPU, Triton's kernels run on CPU tensors in its interpreter: ``TRITON_INTERPRET=1`` is set here,
before any test imports them (``triton.jit`` reads it when a kernel is defined); tests/kernels/."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault('TRITON_INTERPRET', '1')


def _has_mmengine() -> bool:
    try:
        import mmengine  # noqa: F401
    except ImportError:
        return False
    return True


# --- pytest-xdist workers ----------------------------------------------------------------------------------
WORKER = os.environ.get('PYTEST_XDIST_WORKER')
if WORKER and 'OMP_NUM_THREADS' not in os.environ:
    try:
        _cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        _cores = os.cpu_count() or 1
    _threads = max(1, _cores // int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')))
    os.environ['OMP_NUM_THREADS'] = str(_threads)  # the interpreters the tests start inherit it
    torch.set_num_threads(_threads)


def _module_group(item):
    """The test's module when it uses a fixture of module (or package/session) scope defined there, else None."""
    info = getattr(item, '_fixtureinfo', None)
    if info is None:
        return None
    module = item.nodeid.split('::')[0]
    for defs in info.name2fixturedefs.values():
        for d in defs:
            if d.scope != 'function' and d.baseid and d.baseid.split('::')[0] == module:
                return module
    return None


# The quick loop, `make test-fast` (-m "not slow"), leaves out the tests marked slow by hand (over ~30 s on 2
# cores) and those whose recorded time is over FAST_LIMIT seconds: tests/durations.json, from a `make test` run
# with --durations=0 (docs/testing.md says how to refresh it). `make test` runs them all.
FAST_LIMIT = 3.0
DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'durations.json')


def _mark_recorded_slow(items):
    import json
    with open(DURATIONS) as f:
        recorded = json.load(f)
    for item in items:
        if recorded.get(item.nodeid, 0) > FAST_LIMIT and item.get_closest_marker('slow') is None:
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)  # before -m deselects, and before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    _skip_unavailable(items)
    _mark_recorded_slow(items)
    if WORKER is None:
        return
    for item in items:
        if item.get_closest_marker('xdist_group') is None:
            group = _module_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    # the slow tests first (a stable sort: the rest keep their order), so that no worker ends on one alone
    items.sort(key=lambda item: item.get_closest_marker('slow') is None)


def pytest_configure(config):
    if WORKER is None and getattr(config.option, 'dist', 'no') == 'loadgroup':
        from importlib.metadata import version
        release = lambda name: tuple(int(p) for p in version(name).split('.')[:2] if p.isdigit())  # noqa: E731
        if release('pytest') >= (9, 2) and release('pytest-xdist') <= (3, 8):
            raise pytest.UsageError(
                f"--dist loadgroup: pytest {version('pytest')} ignores the group ids pytest-xdist "
                f"{version('pytest-xdist')} writes (pytest-xdist#1386): `make install` installs pytest<9.2 "
                "(requirements/constraints.txt)")


@pytest.hookimpl(trylast=True)  # after xdist's hook, which appends '@group' to the grouped tests' ids
def pytest_collection_finish(session):
    """Under --dist loadgroup the group travels in the test's id; pytest 9.2 no longer takes xdist's rewrite of it
    (pytest-xdist#1386) and the groups are then silently ignored: stop instead (requirements/constraints.txt)."""
    if WORKER is None or not session.config.getvalue('loadgroup'):
        return
    lost = [item.nodeid for item in session.items
            if item.get_closest_marker('xdist_group') is not None and '@' not in item.nodeid]
    if lost:
        raise pytest.UsageError(f'--dist loadgroup: {len(lost)} grouped tests lost their group (e.g. {lost[0]}); '
                                'pytest-xdist cannot group tests under this pytest (pytest-xdist#1386)')


def _skip_unavailable(items):
    # not item.keywords: it holds 'cuda' of tests/cuda/
    skips = {'cuda': None if torch.cuda.is_available() else 'needs CUDA: not run',
             'mmengine': None if _has_mmengine() else 'needs mmengine: not installed (a torch-only machine)'}
    for marker, reason in skips.items():
        if reason is None:
            continue
        for item in items:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


# --- process-wide state a test must leave as it found it ------------------------------------------------------
_ENV = ('TRITON_INTERPRET', 'NORMDENSE_BACKEND', 'NORMDENSE_DEBUG', 'NORMDENSE_LAYERS_ONLY', 'OMP_NUM_THREADS',
        'CUDA_VISIBLE_DEVICES', 'PYTHONPATH')


def _process_state():
    backend = sys.modules.get('normdense.kernels.backend')
    return dict(env={k: os.environ.get(k) for k in _ENV},
                triton_given_up=backend._STATE['broken'] if backend is not None else None,
                deterministic=(torch.are_deterministic_algorithms_enabled(),  # the second: torch >= 2.1
                               getattr(getattr(torch.utils, 'deterministic', None), 'fill_uninitialized_memory', None)),
                default_dtype=torch.get_default_dtype(), grad_enabled=torch.is_grad_enabled(),
                threads=torch.get_num_threads(), cwd=os.getcwd())


@pytest.fixture(autouse=True)
def _leaves_process_state_alone(request):
    """Fails a test that changes what the next test in its process would see (use monkeypatch, or restore it):
    in an xdist worker the next test is whichever the scheduler hands out."""
    before = _process_state()
    yield
    after = _process_state()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f'{request.node.nodeid} left process-wide state changed (before, after): {changed}'
