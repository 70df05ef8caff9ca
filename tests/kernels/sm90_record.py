"""Recording what the StatNorm layers launch, on CPU tensors, without running a kernel: every Triton launch
is replaced by a record of its arguments, specialized by Triton's own launcher code for an sm_90 target.

Triton's launcher (``JITFunction.run``) binds a launch's arguments with a function built by
``triton.runtime.jit.create_function_from_signature``; for each argument it calls Triton's
``native_specialize_impl``: a pointer whose address is 16-byte aligned gets ``tt.divisibility`` 16, an int
that is not ``do_not_specialize`` gets it when divisible by 16 and becomes a constexpr when it is 1, floats
and bools are never specialized. Here that same binder runs (built for ``make_backend(GPUTarget('cuda', 90,
32))``, which needs no driver) and ``JITFunction._pack_args`` turns its result into (options, signature,
constexprs, attrs): exactly what the launcher would hand ``triton.compile`` on an H100, nothing
re-implemented. Alignment: torch's CPU allocator aligns to 64 bytes and its CUDA one to 512, so every
pointer (views at an offset included) has the same alignment modulo 16 as on the GPU.

Each launch also records, per tensor argument, its element count and size, whether it holds as many
elements as the step's activation (x), and the launch's phase (forward, backward, eval). The ATen operators
issued outside the launches (a layout copy of a channels_last x, a dtype conversion of dy) are counted with
``tests/kernels/launches.py``'s counter and, here, with the activation-sized tensors they read and write.

Imports the layers (they are what launches): this module lives under tests/, never under
normdense/kernels (kernels never import layers)."""
import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

N, CHANNELS, GROUPS = 2, 256, 32  # 2 images x 256 channels; mmdet's GN default of 32 groups where grouped
LEVELS = {'P2': (200, 304), 'P3': (100, 152), 'P4': (50, 76), 'P5': (25, 38), 'P6': (13, 19), 'P7': (7, 10),
          'N256': (7, 7)}
# images per level: N, but a classification batch at ResNet's last stage for N256 (the VJPs' sample blocks and
# dx's second stage, kernels/common.py)
BATCH = {'N256': 256}


def batch(level: str) -> int:
    return BATCH.get(level, N)
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32, 'fp64': torch.float64}
# bf16 x under autocast (float32 parameters; y and dy in bf16: the engine's output keeps x's dtype under
# autocast) and channels_last networks (x and dy strided)
EXTRA = {'bf16-autocast': torch.bfloat16, 'bf16-channels_last': torch.bfloat16, 'fp32-channels_last': torch.float32}


def layer_cases():
    """{case: factory(dtype)} of tests/layers/test_fused.py's CASES at 256 channels: a grouped case takes 32
    groups (the FPN heads' GN), a single-group one (LN-like) keeps 1."""
    from tests.layers.test_fused import CASES
    cases = {}
    for name, make in sorted(CASES.items()):
        args = list(make.args)
        args[0] = CHANNELS
        if len(args) > 1 and args[1] > 1:
            args[1] = GROUPS
        cases[name] = functools.partial(make.func, *args, **make.keywords)
    return cases


class _AtenBytes(TorchDispatchMode):
    """ATen operators outside the launches, with the activation-sized tensors each reads and writes."""

    def __init__(self, act_numel, inside, ops):
        super().__init__()
        self.act_numel, self.inside, self.ops = act_numel, inside, ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.inside[0] and not func.is_view and name not in _free_ops():
            moved = name not in _METADATA
            # an in-place or out= operator's destination is written, not read
            inputs = (args[1:] if name.endswith('_') else args, {k: v for k, v in (kwargs or {}).items() if k != 'out'})
            ins = [t for t in _tensors(inputs) if moved and t.numel() >= self.act_numel]
            outs = [t for t in _tensors(out) if moved and t.numel() >= self.act_numel]
            self.ops.append(dict(op=name, read=sum(t.numel() * t.element_size() for t in ins),
                                 written=sum(t.numel() * t.element_size() for t in outs)))
        return out


_METADATA = {'set_'}  # counted as operators (launches.py does) but moving no data: a tensor re-pointed


@functools.lru_cache(None)
def _free_ops():
    from tests.kernels.launches import _FREE
    return _FREE


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


class Recorder:
    """Replaces ``JITFunction.run`` while active: each launch is bound and specialized as Triton's launcher
    does for sm_90 and appended to ``self.launches``; ``self.variants`` maps each distinct specialization
    (Triton's own cache key: the specialization list and the options) to what ``triton.compile`` takes."""

    def __init__(self, arch=90):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        self.target = GPUTarget('cuda', arch, 32)
        self.backend = make_backend(self.target)
        self.binders = {}
        self.variants = {}  # key -> dict(fn, name, signature, constexprs, attrs, options)
        self.launches = []
        self.phase, self.act_numel, self.inside = None, 0, [0]

    def _binder(self, fn):
        from triton.runtime.jit import create_function_from_signature
        if fn not in self.binders:
            self.binders[fn] = create_function_from_signature(fn.signature, fn.params, self.backend)
        return self.binders[fn]

    def run(self, fn, *args, grid, warmup, **kwargs):
        bound, specialization, options = self._binder(fn)(*args, **kwargs)
        key = (fn.fn.__module__, fn.fn.__qualname__, str(specialization), str(sorted(options.items())))
        if key not in self.variants:
            opts, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
            self.variants[key] = dict(fn=fn, name=fn.fn.__name__, signature=signature, constexprs=constexprs,
                                      attrs=attrs, options=opts, key=key)
        tensors = {name: dict(numel=v.numel(), itemsize=v.element_size(), act=v.numel() >= self.act_numel)
                   for name, v in bound.items() if isinstance(v, torch.Tensor)}
        self.launches.append(dict(key=key, name=fn.fn.__name__, phase=self.phase, tensors=tensors))

    @contextlib.contextmanager
    def active(self):
        from triton.runtime.jit import JITFunction
        from normdense.kernels import backend
        original, interpreted = JITFunction.run, backend.interpreted
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            recorder.inside[0] += 1
            try:
                return recorder.run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                recorder.inside[0] -= 1

        JITFunction.run = run
        backend.interpreted = lambda: True  # CPU tensors take the Triton path; nothing executes
        try:
            yield self
        finally:
            JITFunction.run, backend.interpreted = original, interpreted

    @contextlib.contextmanager
    def step(self, phase, act_numel, aten_ops):
        """Launches and ATen operators of one phase of a step, tagged; ``aten_ops`` gets the ATen records."""
        from tests.kernels.launches import count_launches
        self.phase, self.act_numel = phase, act_numel
        start = len(self.launches)
        with count_launches() as counts, _AtenBytes(act_numel, self.inside, aten_ops):
            yield
        assert counts['triton'] == len(self.launches) - start, (counts['triton'], len(self.launches) - start)
        assert counts['aten'] == len(aten_ops), (counts['ops'], aten_ops)  # the two counters agree


def _layout(t):
    if t.is_contiguous():
        return 'contiguous'
    return 'channels_last' if t.is_contiguous(memory_format=torch.channels_last) else 'strided'


def record_step(recorder, factory, setting, hw, n=N):
    """Records one training step (forward, then backward by ``torch.autograd.grad``: the layer's own work,
    no accumulation into a leaf's .grad) and one eval forward of a fresh layer on x (n, 256, H, W) in
    ``setting`` (a key of DTYPES or EXTRA). Returns {phase: {'launches', 'aten'}, 'x_bytes', layouts}."""
    dtype = DTYPES.get(setting) or EXTRA[setting]
    autocast = setting.endswith('autocast')
    layer = factory()
    layer.backend = 'triton'
    # model.half() / .bfloat16() / .double() casts a whole network; under autocast the parameters stay float32
    layer = layer.to(torch.float32 if autocast else dtype).train()
    params = [p for p in layer.parameters() if p.requires_grad]
    fmt = torch.channels_last if setting.endswith('channels_last') else torch.contiguous_format
    x = torch.empty((n, CHANNELS) + hw, dtype=dtype, memory_format=fmt).requires_grad_(True)  # never read
    out = dict(x_bytes=x.numel() * x.element_size(), x_layout=_layout(x))
    ctx = (lambda: torch.autocast('cpu', dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    # the engine keeps x's dtype under autocast too, on every device (StatNorm2d's dtype policy)
    for phase in ('forward', 'backward', 'eval'):
        start = len(recorder.launches)
        aten = []
        with recorder.step(phase, x.numel(), aten):
            if phase == 'forward':
                with ctx():
                    y = layer(x)
            elif phase == 'backward':  # dy as the network hands it back: y's dtype (autograd casts a
                # gradient to its output's dtype) and x's layout
                dy = torch.empty(y.shape, dtype=y.dtype, memory_format=fmt)
                dx = torch.autograd.grad(y, [x] + params, dy)[0]
            else:
                layer.eval()
                with torch.no_grad(), ctx():
                    layer(x.detach())
        out[phase] = dict(launches=recorder.launches[start:], aten=aten)
    out.update(y_dtype=str(y.dtype).replace('torch.', ''), y_layout=_layout(y), dx_layout=_layout(dx))
    return out
