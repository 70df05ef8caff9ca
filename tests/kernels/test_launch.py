"""The launch cache (``normdense/kernels/launch.py``): what a kept launch hands the compiled kernel's launcher,
where it falls back to ``kernel[grid]``, and that every key the engine makes fixes Triton's own specialization of
the arguments (``native_specialize_impl``, what ``kernel[grid]`` computes on each launch)."""
import collections
import functools
import inspect

import pytest
import torch

triton = pytest.importorskip('triton')
from normdense.kernels import launch as L  # noqa: E402
from tests.engine_cases import engine_cases  # noqa: E402


class FakeKernel:
    """``kernel[grid](*args, **consts)`` as Triton's JIT function is called: records the normal launches and
    returns ``compiled`` (a test double of the compiled kernel, or None as the interpreter returns)."""

    def __init__(self, compiled, arg_names=('x_ptr', 'n', 'BLOCK', 'ACT')):
        self.arg_names, self.compiled, self.normal = list(arg_names), compiled, []

    def __getitem__(self, grid):
        def launch(*args, **consts):
            self.normal.append((grid, args, consts))
            return self.compiled
        return launch


class Compiled37:
    """The launcher shape of triton 3.7's ``CompiledKernel.run`` (``CudaLauncher.__call__``)."""

    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], 'fn', 'meta'
        self.run = self._Run(self.calls)

    class _Run:
        def __init__(self, calls):
            self.calls = calls

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            self.calls.append((gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                               launch_enter_hook, launch_exit_hook, args))


def test_a_kept_launch_calls_the_compiled_launcher_with_the_constexprs_in_kernel_order():
    compiled = Compiled37()
    kernel = FakeKernel(compiled)
    launcher = L.Launcher(kernel)
    x = torch.zeros(4)
    launcher((2, 1, 1), (x, 4), {'ACT': 3, 'BLOCK': 128, 'num_warps': 4}, key=(-1, 'k'))
    assert len(kernel.normal) == 1 and compiled.calls == []  # the first launch: kernel[grid], then kept
    assert launcher.hit((5, 2, 1), (x, 7), (-1, 'k'))
    assert len(kernel.normal) == 1
    (gx, gy, gz, stream, function, meta, launch_meta, enter, leave, args), = compiled.calls
    assert (gx, gy, gz, function, meta, launch_meta, enter, leave) == (5, 2, 1, 'fn', 'meta', None, None, None)
    assert args == (x, 7, 128, 3)  # runtime arguments, then BLOCK and ACT in the kernel's order (not the dict's)
    assert not launcher.hit((1, 1, 1), (x, 7), (-1, 'other'))  # another key: nothing kept for it


@pytest.mark.parametrize('case', ['interpreter', 'no packed metadata', 'another launcher',
                                  'constexpr missing', 'no key'])
def test_falls_back_to_kernel_grid_where_the_launcher_is_not_what_it_expects(case):
    compiled = Compiled37()
    names = ('x_ptr', 'n', 'BLOCK', 'ACT')
    if case == 'interpreter':
        compiled = None
    elif case == 'no packed metadata':
        del compiled.packed_metadata
    elif case == 'another launcher':  # e.g. a Triton whose launcher takes the grid as one tuple
        compiled.run = lambda grid, stream, function, *args: None
    elif case == 'constexpr missing':
        names = ('x_ptr', 'n', 'BLOCK', 'ACT', 'V')
    kernel = FakeKernel(compiled, names)
    launcher = L.Launcher(kernel)
    key = None if case == 'no key' else (-1, 'k')
    x = torch.zeros(4)
    for _ in range(3):
        launcher((2, 1, 1), (x, 4), {'ACT': 3, 'BLOCK': 128}, key=key)
    assert len(kernel.normal) == 3 and launcher.cache == {}
    if compiled is not None:
        assert compiled.calls == []


def test_a_launch_hook_set_later_is_called_through_kernel_grid():
    """A profiler that adds a launch hook after the first launch (triton's knobs.runtime hook chains) sees every
    later launch: the kept launcher is bypassed while a hook is set."""
    from triton import knobs
    compiled = Compiled37()
    kernel = FakeKernel(compiled)
    launcher = L.Launcher(kernel)
    x = torch.zeros(4)
    launcher((1, 1, 1), (x, 4), {'ACT': 0, 'BLOCK': 16}, key=(-1, ))
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert not launcher.hit((1, 1, 1), (x, 4), (-1, ))  # the caller makes the normal launch (tensors)
        launcher((1, 1, 1), (x, 4), {'ACT': 0, 'BLOCK': 16}, key=(-1, ))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(kernel.normal) == 2 and compiled.calls == []
    assert launcher.hit((1, 1, 1), (x, 4), (-1, )) and len(compiled.calls) == 1


def test_the_installed_triton_launcher_fits():
    """The launcher class of the installed Triton (3.7 here, 3.6 on the GPU machines; 3.8 and 3.9 checked too,
    docs/gpu.md) takes what a kept launch passes; a 3.6-shaped one (all after ``function`` as ``*args``) too;
    others do not."""
    from triton.backends.nvidia.driver import CudaLauncher
    assert L.launcher_fits(CudaLauncher.__new__(CudaLauncher))
    # what Launcher.hit passes, bound to the installed launcher's own signature: each value where it is read
    call = inspect.signature(CudaLauncher.__call__)
    bound = call.bind('self', 5, 2, 1, 'stream', 'function', 'packed', None, None, None, 'x', 7, 128)
    names = list(call.parameters)
    assert [bound.arguments[n] for n in names[1:6]] == [5, 2, 1, 'stream', 'function'], names
    assert bound.arguments[names[-1]] == ('x', 7, 128)  # the kernel's arguments, as *args
    if len(names) > 7:  # 3.7-3.9: the metadata and the two hooks by name (3.6: in *args)
        assert [bound.arguments[n] for n in names[6:10]] == ['packed', None, None, None], names

    class Launcher36:
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            pass
    assert L.launcher_fits(Launcher36())
    assert not L.launcher_fits(lambda grid, stream, *args: None)
    assert not L.launcher_fits(lambda gridX, gridY, gridZ, stream, function, meta: None)
    # the compiled kernel exposes the launcher as run, with function and packed_metadata (read by direct())
    from triton.compiler.compiler import CompiledKernel
    assert isinstance(inspect.getattr_static(CompiledKernel, 'run'), property)
    assert 'packed_metadata' in inspect.getsource(CompiledKernel.__init__)


def test_the_installed_triton_normal_launch_calls_the_launcher_as_a_kept_launch_does():
    """``kernel[grid]`` of the installed Triton (``JITFunction.run``) calls the compiled kernel's launcher as
    :meth:`Launcher.hit` does: the grid's three sizes, the stream, ``kernel.function``, ``kernel.packed_metadata``,
    the launch metadata, the two hook chains, then the bound arguments, constexprs included
    (``*bound_args.values()``), read from the installed source (3.6-3.9: the same call)."""
    import ast
    import textwrap
    from triton.runtime.jit import JITFunction
    tree = ast.parse(textwrap.dedent(inspect.getsource(JITFunction.run)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == 'run' and ast.unparse(n.func.value) == 'kernel']
    assert len(calls) == 1, [ast.unparse(c) for c in calls]
    args = [ast.unparse(a) for a in calls[0].args]
    assert not calls[0].keywords and len(args) == 10, args
    assert args[:3] == ['grid_0', 'grid_1', 'grid_2'] and args[3] == 'stream', args
    assert args[4:6] == ['kernel.function', 'kernel.packed_metadata'], args
    assert args[7:9] == ['knobs.runtime.launch_enter_hook', 'knobs.runtime.launch_exit_hook'], args
    assert args[9] == '*bound_args.values()', args  # what the kept launch passes: args, then the constexprs


def test_a_kept_launch_passes_what_the_normal_launch_binds(monkeypatch):
    """The engine's kept launches pass the rows of its stacked buffers (coefficients, [dm; dv], gB, the first
    stage's mean, var and update) as integer addresses: for every launch of a training step, the kept launch passes
    one argument per kernel parameter, in the order the installed Triton binds the normal launch's arguments (the
    kernel's own signature, constexprs included: what ``kernel[grid]`` hands the same launcher); each integer in
    a tensor's place is that tensor's data_ptr, and every other argument is the same object or value."""
    if L.stubbed():
        pytest.skip('stub_launches active elsewhere')
    kept, normal = [], []
    monkeypatch.setattr(L, '_no_launch', lambda *a: kept.append(a[9:]))  # the stubbed launcher, recording
    original_hit, original_launch = L.Launcher.hit, L.Launcher.launch

    def both(self, grid, args, key):  # the kept launch, then False: the caller's normal launch follows
        original_hit(self, grid, args, key)
        return False

    def recording(self, grid, args, consts, key=None):
        if key is not None and key in self.cache:
            # Triton's binder: the kernel's signature bound, defaults applied (jit.create_function_from_signature)
            # (the interpreter's kernel object keeps the function itself: the same signature)
            sig = getattr(self.kernel, 'signature', None) or inspect.signature(self.kernel.fn)
            bound = sig.bind(*args, **{k: v for k, v in consts.items() if k in self.kernel.arg_names})
            bound.apply_defaults()
            normal.append((self.name, tuple(bound.arguments.values())))
        return original_launch(self, grid, args, consts, key)
    monkeypatch.setattr(L.Launcher, 'hit', both)
    monkeypatch.setattr(L.Launcher, 'launch', recording)
    compared = collections.Counter()
    with L.stub_launches():
        for name, make in _engine_cases():
            layer = make().double().train()
            x = torch.randn(2, 16, 3, 5, dtype=torch.float64, requires_grad=True)
            for _ in range(2):
                del kept[:], normal[:]
                layer(x).sum().backward()
                if not kept:
                    continue  # the first step: nothing kept yet
                assert len(kept) == len(normal) >= 4, name  # 6 with kernel maps; a layer without: its stats kernel
                for tail, (kernel, args) in zip(kept, normal):
                    assert len(tail) == len(args), (name, kernel, len(tail), len(args))
                    for i, (a, b) in enumerate(zip(tail, args)):
                        if isinstance(a, int) and isinstance(b, torch.Tensor):
                            assert a == b.data_ptr(), (name, kernel, i)
                            compared[kernel] += 1
                        else:
                            assert a is b or a == b, (name, kernel, i)
    # the coefficients in the map, apply, sums, dx; [dm; dv] in the VJP and dx; BCN's gB
    assert set(compared) >= {'_bcn_map_kernel', '_bcn_vjp_kernel', '_coeff_map_kernel', '_coeff_vjp_kernel',
                             '_apply_kernel', '_sums_kernel', '_dx_kernel'}, compared


def test_the_installed_triton_launcher_takes_an_integer_pointer():
    """The kept launches pass some pointers as integer addresses: the installed Triton's CUDA launcher takes a Python
    int for a pointer argument as the address itself (3.7: ``extractPointer`` in driver.c; 2.x to 3.6: the
    generated launcher's ``getPointer``, a template in driver.py, with the same branch)."""
    import os
    import re
    from triton.backends.nvidia import driver
    folder = os.path.dirname(driver.__file__)
    sources = [open(os.path.join(folder, name)).read() for name in ('driver.c', 'driver.py')
               if os.path.exists(os.path.join(folder, name))]
    function = re.compile(r'(?:getPointer|extractPointer)\([^)]*PyObject \*obj[^)]*\)\s*\{+(.*?)data_ptr', re.S)
    bodies = [f.group(1) for src in sources for f in function.finditer(src)]
    assert bodies, 'no pointer extraction found in the installed launcher'
    integer = re.compile(r'if \(PyLong_Check\(obj\)\)\s*\{+\s*(?:ptr_info\.dev_ptr|\*dev_ptr) = '
                         r'PyLong_AsUnsignedLongLong\(obj\);\s*return')
    assert all(integer.search(body) for body in bodies), bodies


# --- the engine's keys against Triton's specialization -----------------------------------------------------------
def _specialization(kernel, args, consts):
    """Triton's specialization of a launch: per runtime argument what native_specialize_impl gives (the type, 16-byte
    alignment of pointers, 1 and divisibility of specialized integers), the constexprs and options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    fn = getattr(kernel, 'fn', kernel)
    dns = set(getattr(kernel, 'do_not_specialize', None) or getattr(kernel, 'kwargs', {}).get('do_not_specialize', ()))
    params = list(inspect.signature(fn).parameters)
    spec = []
    for name, value in zip(params, args):
        spec.append(native_specialize_impl(BaseBackend, value, False, name not in dns, True))
    return repr(spec), tuple(sorted((k, repr(v)) for k, v in consts.items()))


def _engine_cases(c=16):
    """Every declared engine layer's cases with ``c`` channels (groups of 4, or 2 where 4 does not divide c;
    tests/engine_cases.py: a layer a test module declares is one too), and a BCN with another eps (a constexpr of
    the map: a key without the plan's configuration would share its kernels with the first BCN's)."""
    cases = engine_cases(c, 4 if c % 4 == 0 else 2, backend='triton')
    yield from cases.items()
    yield 'bcn-estimate-eps', functools.partial(cases['bcn-estimate'], eps=1e-2)


def test_every_engine_key_fixes_tritons_specialization():
    """Every layer and mode (two BCNs differing in eps only), float64/float32/bf16 autocast, NCL and channels_last,
    several sizes (rows whose length is not a 16-byte multiple; 6 channels: fp32 per-channel rows not 16-byte
    aligned either), training with one and two calls per iteration and eval: a launch key the engine makes never
    meets two of Triton's specializations (the kept kernel would be the wrong one)."""
    if L.stubbed():
        pytest.skip('stub_launches active elsewhere')
    seen = collections.defaultdict(set)
    original = L.Launcher.launch

    def recording(self, grid, args, consts, key=None):
        if key is not None:
            seen[(self.name, key)].add(_specialization(self.kernel, args, consts))
        return original(self, grid, args, consts, key)

    def hit(self, grid, args, key):
        return False  # every launch goes through launch(), recorded
    L.Launcher.launch, saved_hit = recording, L.Launcher.hit
    L.Launcher.hit = hit
    try:
        with L.stub_launches():
            for c, name, make in [(c, *case) for c in (16, 6) for case in _engine_cases(c)]:
                for dtype in (torch.float64, torch.float32):
                    layer = make().to(dtype)
                    for shape in ((2, c, 3, 5), (3, c, 4, 4), (1, c, 1, 7)):
                        for cl in (False, True):
                            x = torch.randn(*shape, dtype=dtype)
                            if cl:
                                x = x.to(memory_format=torch.channels_last)
                            x.requires_grad_()
                            layer.train()
                            layer(x).sum().backward()
                            layer(x * 2).sum().backward()
                            layer.eval()
                            with torch.no_grad():
                                layer(x)
                    with torch.autocast('cpu', dtype=torch.bfloat16):
                        layer.train()
                        layer(torch.randn(2, c, 3, 3).bfloat16().requires_grad_()).float().sum().backward()
    finally:
        L.Launcher.launch, L.Launcher.hit = original, saved_hit
    assert len(seen) > 100
    clashes = {k: v for k, v in seen.items() if len(v) > 1}
    assert not clashes, list(clashes)[:3]


def _cpu_replicate(monkeypatch):
    """torch.nn.parallel.replicate with its CUDA broadcast replaced by views (parameters: non-leaf, as Broadcast's
    copies) and detached copies (buffers): nn.DataParallel's module copies, made anew every step, on the CPU."""
    import importlib
    R = importlib.import_module('torch.nn.parallel.replicate')  # the module (the package exports the function)

    def broadcast(tensors, devices, detach=False):
        return [[t.detach().clone() if detach else t.view_as(t) for t in tensors] for _ in devices]
    monkeypatch.setattr(R, '_broadcast_coalesced_reshape', broadcast)
    monkeypatch.setattr(R, '_get_device_index', lambda device, optional=False, allow_cpu=False: 0)
    return R.replicate


def test_data_parallel_replicas_reuse_plans_and_kept_launches(monkeypatch):
    """nn.DataParallel replicates the model every step (new module objects, their attributes set anew): the
    replicas find their plans and kept launches again, so the launch caches stay the size the first step left
    (before: every launch missed and each cache grew by an entry per layer and step)."""
    if L.stubbed():
        pytest.skip('stub_launches active elsewhere')
    replicate = _cpu_replicate(monkeypatch)
    x = torch.randn(2, 16, 3, 5, dtype=torch.float64)
    with L.stub_launches():
        model = torch.nn.Sequential(*(make() for _, make in _engine_cases())).double()
        sizes, hits = [], []
        for _ in range(5):
            replica, = replicate(model, [0])
            with L.counting() as counted:
                replica(x.requires_grad_()).sum().backward()
            sizes.append(sum(len(one.cache) for one in L._ALL))
            hits.append(counted[0] - counted[1])
    assert sizes[0] > 0 and sizes == [sizes[0]] * 5, sizes
    assert hits[1:] == [counted[0]] * 4, hits  # every launch of a later step is a kept one


def test_the_caches_are_bounded(monkeypatch):
    """Variable input sizes (detection) make new launch keys and geometries; past their bounds the oldest go and
    the outputs stay right."""
    if L.stubbed():
        pytest.skip('stub_launches active elsewhere')
    from normdense.kernels import triton as T
    from normdense.layers.bcn import BatchChannelNorm2d
    monkeypatch.setattr(L, 'MAX_KEPT', 3)
    monkeypatch.setattr(T, '_MAX_GEOMETRY', 4)
    monkeypatch.setattr(T, '_GEOMETRY', {})
    layer = BatchChannelNorm2d(16, 4, mode='batch', backend='triton').double()
    with L.stub_launches():
        for length in range(1, 9):
            layer(torch.randn(2, 16, 1, length, dtype=torch.float64, requires_grad=True)).sum().backward()
            assert max(len(one.cache) for one in L._ALL) <= 3
            assert len(T._GEOMETRY) <= 4
        assert max(len(one.cache) for one in L._ALL) == 3


def test_kept_launches_ask_for_the_stream_of_their_keys_device(monkeypatch):
    """Two (fake) CUDA devices, taken in turns: the launch keys name the device, and a kept launch asks for the
    current stream of that device (Triton launches on it), whichever device is current when the step starts."""
    if L.stubbed():
        pytest.skip('stub_launches active elsewhere')
    from normdense.kernels import backend as B
    from normdense.layers.bcn import BatchChannelNorm2d
    current, which, asked, streams, keys = [0], [0], [], [], set()

    class FakeDevice:  # torch.cuda.device on a machine without one
        def __init__(self, device):
            self.index = torch.device(device).index if not isinstance(device, int) else device

        def __enter__(self):
            self.prev, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.prev

    monkeypatch.setattr(torch._C, '_cuda_getCurrentRawStream', lambda d: asked.append(d) or 1000 + d, raising=False)
    monkeypatch.setattr(B, 'current_device', lambda: current[0])
    monkeypatch.setattr(B, '_device_of', lambda t: torch.device('cuda', which[0]))
    monkeypatch.setattr(torch.cuda, 'device', FakeDevice)
    monkeypatch.setattr(L, '_no_launch', lambda *a: streams.append((which[0], a[3])))
    hit = L.Launcher.hit
    monkeypatch.setattr(L.Launcher, 'hit', lambda self, grid, args, key: keys.add(key[0]) or hit(self, grid, args, key))
    x = torch.randn(2, 16, 3, 5, dtype=torch.float64, requires_grad=True)
    with L.stub_launches():
        layers = [BatchChannelNorm2d(16, 4, mode='batch', backend='triton').double() for _ in range(2)]
        for device in (0, 1, 0, 1, 1, 0):
            which[0] = device
            layers[device](x).sum().backward()
    assert keys == {0, 1}
    assert streams and {s for _, s in streams} == {1000, 1001}
    assert all(s == 1000 + d for d, s in streams), streams
    assert set(asked) == {0, 1} and current[0] == 0
