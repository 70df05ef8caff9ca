"""Kernel launches through a cache of compiled kernels: what one launch costs the host.

``kernel[grid](*args, **consts)`` takes 10-20 us in triton 3.6/3.7: it binds and specializes every argument,
then looks the compiled kernel up. A launch site that knows what its specialization depends on passes a
``key``: the first launch under a key goes through ``kernel[grid]`` (which compiles), and the compiled kernel's
own launcher is kept under the key; later launches call it directly, as sglang's ``CachedKernel``, FlagGems'
``LibEntry`` and Inductor's static launcher do.

A key must determine Triton's specialization of the arguments: the tensors' dtypes and 16-byte alignment, the
integers that are not ``do_not_specialize``, the constexprs and options, and the device: a key is a tuple whose
first item is the device's index (-1 for a CPU tensor). The engine makes one per call (``layers/_statnorm.py``):
the layer's plan, x's shape, strides and dtype, the parameters' dtypes and the first stage's mode; every kernel
has its own cache, and each launches once per step.
``tests/kernels/test_launch.py`` checks every site's keys against Triton's own ``native_specialize_impl``.

The normal launch is taken (nothing kept) without a key, under Triton's interpreter (no compiled kernel), while
a launch hook is set (``knobs.runtime.launch_enter_hook``: a profiler), and where the compiled kernel is not what
this file expects (:func:`direct`): the launcher's internals differ between Triton versions.

:func:`stub_launches` is the one point where a benchmark on a machine without a GPU replaces the launches by
no-ops (the driver calls), so that everything above them is measured (``benchmarks/host.py``).
"""
import contextlib
import inspect

import torch

# the compiled kernel's launcher, triton 3.6 to 3.9: run(gridX, gridY, gridZ, stream, function, packed_metadata,
# launch_metadata, launch_enter_hook, launch_exit_hook, *args) (3.6 takes all after `function` as *args; 3.8 and 3.9
# read from their sources and checked by the CPU tests, docs/gpu.md)
_RUN_HEAD = ('gridX', 'gridY', 'gridZ', 'stream', 'function')
_RUN_REST = ('kernel_metadata', 'launch_metadata', 'launch_enter_hook', 'launch_exit_hook')
_STUB = [False]  # stub_launches() is active
MAX_KEPT = 1024  # kept launchers per kernel (shapes x configurations): past it the oldest goes, as a miss costs
# one normal launch (Triton's own cache keeps the compiled kernel)


_no_stream = abs  # stubbed launches: a builtin as cheap as the CUDA query (its value is not read)
# a stubbed launch's kept launcher: a builtin that takes any positional arguments and ignores them (a Python
# function would add a frame that a real launch, a call into the compiled launcher, does not have)
_no_launch = ''.format


class Launcher:
    """A kernel's launches: ``launch(grid, args, consts, key)`` is ``kernel[grid](*args, **consts)`` and keeps, under
    ``key``, the compiled kernel's own launcher; ``hit(grid, args, key)`` launches through it where one is kept
    (True) and does nothing otherwise (False, also while a launch hook is set): the caller then makes the normal
    launch, and builds ``consts`` only then. ``args``: the runtime arguments in the kernel's order, one list for
    both launches; ``consts``: its constexprs by name, then options (num_warps).

    ``rows``: the kernel's pointer parameters that a launch site may give as an integer address, a row of a buffer
    that holds several (``common.stacked``; the first stage's mean, var and update): the kept launch passes the
    address as it is (Triton's launcher takes an int for a pointer: no tensor object per row), and the normal launch
    takes ``bind(args, *buffers)``, where each such address is a view of the buffer it points into
    (``kernel[grid]`` would read an integer as an integer)."""
    __slots__ = ('kernel', 'cache', 'name', 'rows')

    def __init__(self, kernel, rows=()):
        self.kernel, self.cache = kernel, {}
        self.name = getattr(kernel, '__name__', repr(kernel))
        names = list(getattr(kernel, 'arg_names', ()))
        self.rows = tuple(names.index(r) for r in rows)  # a ValueError for a name the kernel does not have

    def bind(self, args, *buffers) -> tuple:
        """``args`` with each integer address in a ``rows`` position replaced by a view of the one of ``buffers``
        (contiguous tensors, or None) it points into, from that address on: the normal launch's arguments."""
        out = list(args)
        for i in self.rows:
            a = out[i]
            if type(a) is not int:
                continue
            for b in buffers:
                delta = -1 if b is None else a - b.data_ptr()
                if 0 <= delta < b.numel() * b.itemsize:
                    out[i] = b.reshape(-1)[delta // b.itemsize:]
                    break
            else:
                raise ValueError(f'{self.name}: argument {i} is an address in none of the buffers given')
        return tuple(out)

    def hit(self, grid, args, key) -> bool:
        d = self.cache.get(key)
        if d is None:
            return False
        run, function, packed, tail, device, runtime, enter, leave, stream = d
        if runtime.launch_enter_hook is not enter or enter.calls or runtime.launch_exit_hook is not leave \
                or leave.calls:  # a hook now (a profiler): the caller's normal launch calls it
            return False
        run(grid[0], grid[1], grid[2], stream(device), function, packed, None, None, None, *args, *tail)
        return True

    def __call__(self, grid, args, consts, key=None):
        if key is None or not self.hit(grid, args, key):
            self.launch(grid, args, consts, key)

    def launch(self, grid, args, consts, key=None) -> None:
        compiled = _StubCompiled() if _STUB[0] else self.kernel[grid](*args, **consts)
        if key is not None:
            kept = direct(self.kernel, compiled, len(args), consts, key[0])
            if kept is not None:
                cache = self.cache
                if len(cache) >= MAX_KEPT:
                    del cache[next(iter(cache))]
                cache[key] = kept


def direct(kernel, compiled, nargs: int, consts: dict, device):
    """What :meth:`Launcher.hit` needs to call ``compiled``'s launcher directly, or None where that is not what
    ``kernel[grid]`` does: no compiled kernel (the interpreter), a launcher of another shape (another Triton),
    constexprs not after the runtime arguments. ``device``: the CUDA device index the kernel was compiled for
    (its current stream is asked per launch), -1 for the CPU (stubbed launches)."""
    if compiled is None:
        return None
    try:
        from triton import knobs
        runtime = knobs.runtime
        enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    except (ImportError, AttributeError):  # an older triton: no hook chains
        return None
    if not _chain(enter) or not _chain(leave):
        return None
    names = getattr(kernel, 'arg_names', None)
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        tail = tuple(consts[n] for n in names[nargs:])  # the constexprs' values in the kernel's order
    except (AttributeError, KeyError, TypeError):
        return None
    if not launcher_fits(run):
        return None
    if isinstance(compiled, _StubCompiled):
        run = _no_launch
    # the current stream, as triton's driver asks it
    stream = torch._C._cuda_getCurrentRawStream if device >= 0 else _no_stream
    return run, function, packed, tail, device, runtime, enter, leave, stream


def _chain(hook) -> bool:
    """Whether ``hook`` is triton's hook chain (3.6 to 3.9: a HookChain, empty unless a profiler added one)."""
    return isinstance(getattr(hook, 'calls', None), list)


def launcher_fits(run) -> bool:
    """Whether ``run`` (a compiled kernel's launcher) takes the arguments as triton 3.6 to 3.9's do."""
    call = run if inspect.isfunction(run) or inspect.ismethod(run) else getattr(type(run), '__call__', None)
    if call is None:
        return False
    try:
        params = list(inspect.signature(call).parameters.values())
    except (TypeError, ValueError):
        return False
    if params and params[0].name == 'self':
        params = params[1:]
    names = tuple(p.name for p in params)
    if names[:5] != _RUN_HEAD or not params[-1].kind == inspect.Parameter.VAR_POSITIONAL:
        return False
    return names[5:-1] in ((), _RUN_REST)


class _StubCompiled:
    """What a stubbed launch returns: a compiled kernel whose launcher does nothing."""
    function, packed_metadata = 0, None

    @staticmethod
    def run(gridX, gridY, gridZ, stream, function, *args):
        return None


@contextlib.contextmanager
def stub_launches():
    """Every launch a no-op while active (the driver call replaced; nothing runs): the host cost of a step on a
    machine without a GPU. What was kept meanwhile is forgotten after (:func:`clear`)."""
    clear()  # nothing compiled before runs meanwhile
    _STUB[0] = True
    try:
        yield
    finally:
        _STUB[0] = False
        clear()


def stubbed() -> bool:
    """Whether :func:`stub_launches` is active (the engine then caches launches on CPU tensors too)."""
    return _STUB[0]


_ALL = []


def launcher(kernel, rows=()) -> Launcher:
    """The :class:`Launcher` of ``kernel`` (one per kernel, module level); ``rows``: as the class says."""
    out = Launcher(kernel, rows)
    _ALL.append(out)
    return out


@contextlib.contextmanager
def counting():
    """Yields a list: [launches made meanwhile, kept or not; those of them through :meth:`Launcher.launch`]
    (the benchmarks' count)."""
    counter = [0, 0]
    hit, launch = Launcher.hit, Launcher.launch

    def counted_hit(self, grid, args, key):
        done = hit(self, grid, args, key)
        counter[0] += done
        return done

    def counted_launch(self, grid, args, consts, key=None):
        counter[0] += 1
        counter[1] += 1
        return launch(self, grid, args, consts, key)

    Launcher.hit, Launcher.launch = counted_hit, counted_launch
    try:
        yield counter
    finally:
        Launcher.hit, Launcher.launch = hit, launch


def clear() -> None:
    """Forget every kept compiled kernel (a launch hook installed later is then seen)."""
    for one in _ALL:
        one.cache.clear()
