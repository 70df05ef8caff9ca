"""Compiling a recorded kernel variant for sm_90 on a machine without a GPU, and reading what it does to
memory from its compiled code (Triton's compiler and bundled ptxas need no device).

``compile_variant`` hands ``triton.compile`` exactly what Triton's launcher would (tests/kernels/sm90_record.py)
and returns the TTIR, the PTX and ptxas's resource lines (Triton runs ``ptxas -v`` itself; its log is caught
with ``knobs.nvidia.dump_ptxas_log``, or, where the cubin came from Triton's cache, the bundled ptxas is run
on the PTX with the same options).

Which argument an access touches, and how wide it is (``memory_accesses``):
  1. TTIR: every ``tt.load`` / ``tt.store`` / ``tt.atomic_*`` is traced back through its pointer operand
     (``tt.addptr``, ``tt.splat``, ``tt.broadcast``, ``tt.expand_dims``, ``arith.select``, a loop's
     ``iter_args``, ...) to the kernel's pointer argument(s); it is a *block* access when its pointer is a
     tensor of pointers (a tile: what streams over an activation) and a *single* one when it is one pointer
     (a per-row scalar, x's first value as a shift). Its source location is the innermost file:line:col of
     its ``loc`` (through ``callsite`` and named locations).
  2. PTX: every ``ld.global`` / ``st.global`` / ``atom.global`` / ``red.global`` / ``cp.async`` takes the source
     location of the nearest ``.loc`` before it (LLVM emits one wherever the location changes, so that is the
     instruction's own; inside an inline asm block, Triton's loads and stores, the block's first: triton 3.8
     and 3.9 write a .loc before each of its lines, the line number counted up) and is matched to the TTIR
     accesses at the same location; its width is the vector
     count (.v2/.v4) x the element bits of its type (.b16/.b32/.f64/...), or cp.async's copy size.
  3. Per argument, the narrowest instruction of its block accesses, in bytes and in elements of the
     argument's own type: 1 element per instruction is a scalar access (``ld.global.b16`` of bf16).
Whether an argument is activation-sized is the recorded launches' business (its element count).

``calibrate`` runs this reading on two copy kernels compiled here (an aligned tile: 8 bf16 per instruction; a
row at an unspecialized length: 1), so a parser that misreads widths fails the report rather than passing it.

fp64 approximations (``fp64_approx``): a PTX instruction with ``.approx`` whose type is f64 or that takes an
f64 register (%fd): ``rsqrt.approx.f64``, ``rcp.approx.ftz.f64``, ... (``tl.rsqrt`` on float64 lowers to
the first; ``div.rn.f64`` / ``sqrt.rn.f64`` are exact)."""
import contextlib
import io
import os
import re
import subprocess
import tempfile
import time

# the size arguments: declared do_not_specialize, so a new image or batch size (divisible by 16 or not, 1 or
# not) never makes Triton compile another variant
SIZES = {'N', 'C', 'G', 'L', 'ROWS', 'CHUNK', 'SPLIT', 'SIZE', 'PER', 'per', 'S', 'GSPLIT', 'GSTRIDE',
         'fL', 'fCHUNK', 'fSPLIT'}  # the f*: a map kernel's folded first stage


_TYPES = {'torch.float32': 'fp32', 'torch.float64': 'fp64', 'torch.float16': 'fp16', 'torch.bfloat16': 'bf16',
          'torch.int64': 'i64', 'torch.int32': 'i32', 'torch.bool': 'i1'}


def _sig(value):
    """Triton's signature type of a launch argument (for the probes that build a signature by hand)."""
    if hasattr(value, 'data_ptr') and hasattr(value, 'dtype'):  # a tensor (this module imports no torch)
        return '*' + _TYPES[str(value.dtype)]
    if isinstance(value, bool):
        return 'i1'
    if isinstance(value, int):
        return 'i64' if abs(value) >= 2 ** 31 else 'i32'
    if isinstance(value, float):
        return 'fp32'
    if isinstance(value, tuple):  # a tuple argument (the map kernels' folded first stage)
        return tuple(_sig(v) for v in value)
    raise TypeError(f'unexpected kernel argument {value!r}')


def specialized_sizes(fn):
    """The size arguments of a JITFunction that a launcher would specialize."""
    return sorted(p.name for p in fn.params if p.name in SIZES and not p.do_not_specialize)


def compile_variant(variant, target):
    """dict(ok, error, ttir, ptx, ptxas, seconds) of one recorded variant compiled for ``target``."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource
    start = time.time()
    log = io.StringIO()
    src = ASTSource(fn=variant['fn'], signature=variant['signature'], constexprs=variant['constexprs'],
                    attrs=variant['attrs'])
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=variant['options'].__dict__)
    except Exception as e:  # every failing variant is reported, not only the first
        msg = str(e).strip().splitlines()
        return dict(ok=False, error=f'{type(e).__name__}: {msg[0] if msg else ""}', seconds=time.time() - start)
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    ptx = compiled.asm['ptx']
    ptxas = log.getvalue() if 'Used' in log.getvalue() else run_ptxas(ptx, target.arch)
    return dict(ok=True, error=None, ttir=compiled.asm['ttir'], ptx=ptx, ptxas=ptxas,
                shared=getattr(compiled.metadata, 'shared', None), seconds=time.time() - start)


def run_ptxas(ptx, arch):
    """``ptxas -v`` on ``ptx``: the bundled ptxas Triton picks for ``arch`` (``get_ptxas``: 3.7 and 3.8 ``ptxas``
    for sm_90, 3.9 ``ptxas-blackwell``), with the options and architecture name (sm_90a) Triton compiles with."""
    from triton.backends.nvidia.compiler import get_ptxas
    gpu = f'sm_{arch}a' if arch >= 90 else f'sm_{arch}'  # Triton's sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, 'k.ptx')
        with open(path, 'w') as f:
            f.write(ptx)
        proc = subprocess.run([get_ptxas(arch).path, '-lineinfo', '-v', '--regAllocOptLevel=2',
                               f'--gpu-name={gpu}', path, '-o', path + '.o'], capture_output=True, text=True)
    return proc.stdout + proc.stderr


def ptxas_resources(log):
    """(registers, spill store bytes, spill load bytes) from ``ptxas -v``'s lines (None where absent): the most
    registers and the spills summed over the functions it lists (a kernel and its noinline callees)."""
    regs = [int(r) for r in re.findall(r'Used (\d+) registers', log)]
    spills = re.findall(r'(\d+) bytes spill stores, (\d+) bytes spill loads', log)
    return (max(regs) if regs else None, *((sum(int(s[0]) for s in spills), sum(int(s[1]) for s in spills))
                                           if spills else (None, None)))


# --- TTIR ---------------------------------------------------------------------------------------------------
_LOC_DEF = re.compile(r'^#(loc\d*) = loc\((.*)\)\s*$', re.M)
_ARG = re.compile(r'%(\w+): (!tt\.ptr<(\w+)>|\w+)')
_DEF = re.compile(r'^\s*(%[\w#:]+(?:\s*,\s*%[\w#:]+)*) = ([\w.]+)(.*)$')
_MEM_OP = re.compile(r'^\s*(?:%[\w#:]+ = )?(tt\.load|tt\.store|tt\.atomic_rmw|tt\.atomic_cas)\s(.*)$')
_VALUE = re.compile(r'%[\w]+')
_FOLLOW_FIRST = {'tt.addptr', 'tt.splat', 'tt.broadcast', 'tt.expand_dims', 'tt.reshape', 'tt.trans',
                 'ttg.convert_layout', 'tt.bitcast'}


def _resolve_loc(expr, defs, depth=0):
    """(file, line, col) of a location expression: the innermost source position."""
    expr = expr.strip()
    if depth > 50 or expr in ('unknown', ''):
        return None
    m = re.match(r'^#(loc\d*)$', expr)
    if m:
        return _resolve_loc(defs.get(m.group(1), ''), defs, depth + 1)
    m = re.match(r'^"([^"]*)":(\d+):(\d+)', expr)
    if m:
        return m.group(1), int(m.group(2)), int(m.group(3))
    m = re.match(r'^"[^"]*"\((.*)\)$', expr)  # a named location
    if m:
        return _resolve_loc(m.group(1), defs, depth + 1)
    m = re.match(r'^callsite\((\S+) at .*\)$', expr)  # the callee's position (the inlined function's line)
    if m:
        return _resolve_loc(m.group(1), defs, depth + 1)
    m = re.match(r'^fused\[(.*?)(?:,|\])', expr)
    if m:
        return _resolve_loc(m.group(1), defs, depth + 1)
    return None


def _op_loc(line, defs):
    i = line.rfind(' loc(')
    return _resolve_loc(line[i + 5:].rstrip()[:-1], defs) if i >= 0 else None


def ttir_accesses(ttir):
    """(pointer arguments {name: element type}, [dict(op, loc, args, block)]) of a kernel's TTIR."""
    defs = dict(_LOC_DEF.findall(ttir))
    header = next(line for line in ttir.splitlines() if 'tt.func public' in line)
    ptr_args = {name: elt for name, ty, elt in _ARG.findall(header) if elt}
    # MLIR's printer reuses value names in sibling regions (a loop body, an if's branches): definitions are
    # kept per region and a memory op resolves its pointer while its enclosing regions are the ones open
    scopes = [{}]

    def producer(value):
        for scope in reversed(scopes):
            if value in scope:
                return scope[value]
        return None

    def roots(value, seen):
        value = value.split('#')[0]
        if value[1:] in ptr_args:
            return {value[1:]}
        found = producer(value)
        if value in seen or found is None:
            return set()
        seen.add(value)
        op, operands = found
        if op in _FOLLOW_FIRST:
            operands = operands[:1]
        elif op == 'arith.select':
            operands = operands[1:3]
        out = set()
        for o in operands:
            out |= roots(o, seen)
        return out

    accesses = []
    for line in ttir.splitlines():
        stripped = line.strip()
        if stripped.startswith('}'):
            scopes.pop()
        m = _DEF.match(line)
        if m:
            results, op, rest = m.groups()
            operands = _VALUE.findall(rest.split(' loc(')[0].split(' : ')[0])
            for res in (r.strip().split(':')[0] for r in results.split(',')):
                scopes[-1][res] = (op, operands)
        m = _MEM_OP.match(line)
        if m:
            op, rest = m.groups()
            ptr = (_VALUE.findall(rest.split(' : ')[0]) or [None])[0]  # the first operand (atomic_rmw's too)
            types = rest.split(' : ', 1)[1] if ' : ' in rest else ''
            accesses.append(dict(op=op.split('.')[1].split('_')[0], loc=_op_loc(line, defs),
                                 args=sorted(roots(ptr, set())) if ptr else [],
                                 block=types.lstrip().startswith('tensor<')))
        if stripped.endswith('{'):
            scopes.append({})
            for var, init in re.findall(r'(%\w+) = (%[\w#]+)', line[line.find('iter_args('):]
                                        if 'iter_args(' in line else ''):
                scopes[-1][var] = ('iter_arg', [init])
    return ptr_args, accesses


# --- PTX ----------------------------------------------------------------------------------------------------
_PTX_MEM = re.compile(r'^\s*(?:@!?%\w+\s+)?'  # a predicate
                      r'((ld|st|atom|red)\.global[\w.:]*|cp\.async\.\w+\.shared\.global[\w.:]*)\s+(.*)$')
_BITS = re.compile(r'\.[bfsu](8|16|32|64)\b')


def ptx_accesses(ptx):
    """[dict(kind, bytes, loc, text)] of the global memory instructions of a PTX file."""
    files = {}
    for num, path in re.findall(r'^\s*\.file\s+(\d+)\s+(".*")', ptx, re.M):
        parts = re.findall(r'"([^"]*)"', path)
        files[num] = os.path.join(*parts) if len(parts) > 1 else parts[0]
    out, loc = [], None
    inline = None  # inside an inline asm block: how many .loc lines it has had
    for line in ptx.splitlines():
        marker = line.strip()
        if marker == '// begin inline asm':
            inline = 0
            continue
        if marker == '// end inline asm':
            inline = None
            continue
        m = re.match(r'^\s*\.loc\s+(\d+)\s+(\d+)\s+(\d+)', line)
        if m:
            # an inline asm block (Triton's loads and stores) is one instruction with one source location;
            # the LLVM of triton 3.8 and 3.9 writes a .loc before each of its lines, the block's own location, then
            # the line number counted up line by line (8:28, 9:28, 10:28, ...): its first one is the block's
            if inline is None or inline == 0:
                loc = (files.get(m.group(1), m.group(1)), int(m.group(2)), int(m.group(3)))
            if inline is not None:
                inline += 1
            continue
        m = _PTX_MEM.match(line)
        if not m:
            continue
        opcode, kind, operands = m.groups()
        if opcode.startswith('cp.async'):
            size = re.search(r',\s*(0x[0-9a-fA-F]+|\d+)\s*(?:,|;)', operands)
            nbytes = int(size.group(1), 0) if size else None
            kind = 'ld'
        else:
            bits = _BITS.findall(opcode)
            vec = re.search(r'\.v(\d)', opcode)
            nbytes = int(bits[-1]) // 8 * (int(vec.group(1)) if vec else 1) if bits else None
        out.append(dict(kind=kind, bytes=nbytes, loc=loc, text=line.strip()))
    return out


def fp64_approx(ptx):
    """PTX instructions that approximate on float64 values."""
    found = []
    for line in ptx.splitlines():
        code = line.split('//')[0].strip()
        if '.approx' not in code:
            continue
        opcode = re.sub(r'^@!?%\w+\s+', '', code).split()[0]
        if opcode.endswith('.f64') or '%fd' in code:
            found.append(code)
    return found


_ELEMENT_BYTES = {'bf16': 2, 'f16': 2, 'f32': 4, 'f64': 8, 'i1': 1, 'i8': 1, 'i16': 2, 'i32': 4, 'i64': 8}


def memory_accesses(ttir, ptx):
    """Per pointer argument: dict(elt, itemsize, load, store (bools: any block access), load_bytes,
    store_bytes (the narrowest PTX instruction of its block accesses, None if none), load_elems, store_elems,
    single (its one-element accesses)), and the PTX instructions no TTIR access claimed."""
    ptr_args, accesses = ttir_accesses(ttir)
    by_loc = {}
    for a in accesses:
        by_loc.setdefault(a['loc'], []).append(a)
    args = {name: dict(elt=elt, itemsize=_ELEMENT_BYTES.get(elt), load=False, store=False, load_bytes=None,
                       store_bytes=None, single=0) for name, elt in ptr_args.items()}
    for a in accesses:
        for name in a['args']:
            if a['block']:
                args[name]['load' if a['op'] == 'load' else 'store'] = True
            else:
                args[name]['single'] += 1
    unmatched = []
    for ins in ptx_accesses(ptx):
        want = 'load' if ins['kind'] == 'ld' else ('store' if ins['kind'] == 'st' else 'atomic')
        owners = [a for a in by_loc.get(ins['loc'], []) if a['op'] == want and a['block']]
        if not owners and not any(a['op'] == want for a in by_loc.get(ins['loc'], [])):
            unmatched.append(ins['text'])
        for a in owners:
            for name in a['args']:
                slot = 'load_bytes' if want == 'load' else 'store_bytes'
                if ins['bytes'] is not None:
                    old = args[name][slot]
                    args[name][slot] = ins['bytes'] if old is None else min(old, ins['bytes'])
    for info in args.values():
        for kind in ('load', 'store'):
            b = info[f'{kind}_bytes']
            info[f'{kind}_elems'] = None if b is None or not info['itemsize'] else b / info['itemsize']
    return args, unmatched


# --- calibration: the reading above on real compiler output ---------------------------------------------------
def calibrate(target):
    """Problems (an empty list when none) of the access analysis on two copy kernels compiled for ``target``:
    a tile at a 16-byte-aligned offset must read as 8 bf16 per instruction, a row at an unspecialized row
    length (``row * L``: alignment unknown) as 1. Guards the report against a parser that sees wrong widths."""
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    @triton.jit
    def _copy_tiles(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs))

    @triton.jit(do_not_specialize=['L'])
    def _copy_rows(x_ptr, y_ptr, L, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        offs = tl.program_id(0).to(tl.int64) * L + cols
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=cols < L), mask=cols < L)

    aligned = {(0, ): [['tt.divisibility', 16]], (1, ): [['tt.divisibility', 16]]}
    problems = []
    for fn, signature, want in ((_copy_tiles, {'x_ptr': '*bf16', 'y_ptr': '*bf16', 'BLOCK': 'constexpr'}, 8),
                                (_copy_rows, {'x_ptr': '*bf16', 'y_ptr': '*bf16', 'L': 'i32', 'BLOCK': 'constexpr'},
                                 1)):
        block = (len(signature) - 1, )
        compiled = triton.compile(ASTSource(fn, signature, {block: 1024}, aligned), target=target)
        args, unmatched = memory_accesses(compiled.asm['ttir'], compiled.asm['ptx'])
        got = (args['x_ptr']['load_elems'], args['y_ptr']['store_elems'])
        if got != (want, want) or unmatched:
            problems.append(f'{fn.__name__}: read {got} elements per load/store, expected {want}; unmatched '
                            f'{unmatched[:2]}')
    return problems
