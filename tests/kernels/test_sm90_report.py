"""The sm_90 hardware report (benchmarks/sm90_report.py) in CI, without a GPU: every Triton kernel variant the
layers' training and eval steps launch at the FPN shapes P2-P7 and a classification batch (256 images at
7x7) (bf16, fp16, fp32, fp64, bf16 autocast,
channels_last) compiles for an H100 with the launcher's run-time specialization, and each of the report's
checks holds: vector accesses of the activations, no spills, no fp64 approximation, at most 6 launches and
8x the activation bytes per training step. One report run (a subprocess without TRITON_INTERPRET, its own
Triton cache) is shared by one test per check, so each failing check is reported on its own with its list of
violations. The analysis functions are tested on planted inputs first (each check can fail)."""
import json
import os
import subprocess
import sys
import types

import pytest

from tests.kernels import sm90_compile as S
from tests.kernels import sm90_summary as M

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- the analysis on planted inputs ---------------------------------------------------------------------------
TTIR = '''#loc = loc("k.py":1:0)
module {
  tt.func public @k(%x_ptr: !tt.ptr<bf16> {tt.divisibility = 16 : i32} loc("x_ptr"(#loc)), %y_ptr: !tt.ptr<bf16> loc("y_ptr"(#loc)), %m_ptr: !tt.ptr<f32> loc("m_ptr"(#loc)), %L: i32 loc("L"(#loc))) attributes {noinline = false} {
    %m = tt.addptr %m_ptr, %L : !tt.ptr<f32>, i32 loc(#loc1)
    %m_0 = tt.load %m : !tt.ptr<f32> loc(#loc2)
    %cols = tt.make_range {end = 1024 : i32, start = 0 : i32} : tensor<1024xi32> loc(#loc1)
    scf.for %off = %L to %L step %L  : i32 {
      %0 = tt.splat %x_ptr : !tt.ptr<bf16> -> tensor<1024x!tt.ptr<bf16>> loc(#loc3)
      %1 = tt.addptr %0, %cols : tensor<1024x!tt.ptr<bf16>>, tensor<1024xi32> loc(#loc3)
      %2 = tt.load %1 : tensor<1024x!tt.ptr<bf16>> loc(#loc4)
    } loc(#loc1)
    scf.for %off = %L to %L step %L  : i32 {
      %0 = tt.splat %y_ptr : !tt.ptr<bf16> -> tensor<1024x!tt.ptr<bf16>> loc(#loc5)
      %1 = tt.addptr %0, %cols : tensor<1024x!tt.ptr<bf16>>, tensor<1024xi32> loc(#loc5)
      tt.store %1, %cst : tensor<1024x!tt.ptr<bf16>> loc(#loc6)
    } loc(#loc1)
    tt.return loc(#loc1)
  } loc(#loc)
} loc(#loc)
#loc1 = loc("k.py":2:1)
#loc2 = loc("m"("k.py":3:5))
#loc7 = loc("k.py":9:9)
#loc8 = loc("k.py":4:7)
#loc4 = loc(callsite(#loc8 at #loc7))
#loc3 = loc("k.py":4:2)
#loc5 = loc("k.py":6:2)
#loc6 = loc("k.py":6:8)
'''
PTX = '''
\t.loc\t1 3 5
\tld.global.b32 { %r1 }, [ %rd1 + 0 ];
\t.loc\t1 4 7
\t@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];
\t.loc\t1 6 8
\t@%p2 st.global.b16 [ %rd3 + 0 ], { %rs1 };
\t@%p2 st.global.v2.b16 [ %rd3 + 0 ], { %rs1, %rs2 };
\trsqrt.approx.f64 \t%fd2, %fd1;
\trsqrt.approx.ftz.f32 \t%f2, %f1;
\t.file\t1 "k.py"
'''


def test_accesses_traced_to_arguments_through_sibling_regions():
    """Block accesses are traced to their pointer argument (the two loops reuse the names %0, %1), a single
    pointer load is not a block one, and PTX widths are matched by source location: x's v4.b32 = 8 bf16,
    y's narrowest store b16 = 1 element (scalar)."""
    ptr_args, accesses = S.ttir_accesses(TTIR)
    assert ptr_args == {'x_ptr': 'bf16', 'y_ptr': 'bf16', 'm_ptr': 'f32'}
    assert [(a['op'], a['args'], a['block']) for a in accesses] == [
        ('load', ['m_ptr'], False), ('load', ['x_ptr'], True), ('store', ['y_ptr'], True)]
    args, unmatched = S.memory_accesses(TTIR, PTX)
    assert (args['x_ptr']['load_bytes'], args['x_ptr']['load_elems']) == (16, 8)
    assert (args['y_ptr']['store_bytes'], args['y_ptr']['store_elems']) == (2, 1)
    assert args['m_ptr']['single'] == 1 and not args['m_ptr']['load'] and unmatched == []


# the same accesses as triton 3.8 and 3.9 write them (their LLVM): a .loc before each line of an inline asm block,
# the block's own location first, then its line number counted up (4:7, 5:7, ...: no source position of the kernel)
PTX_38 = '''
\t.loc\t1 3 5
\tld.global.b32 { %r1 }, [ %rd1 + 0 ];
\t.loc\t1 4 7
\t// begin inline asm
\t.loc\t1 4 7
\tmov.u32 %r2, 0x0;
\t.loc\t1 5 7
\tmov.u32 %r3, 0x0;
\t.loc\t1 6 7
\tmov.u32 %r4, 0x0;
\t.loc\t1 7 7
\tmov.u32 %r5, 0x0;
\t.loc\t1 8 7
\t@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd2 + 0 ];

\t// end inline asm
\t.loc\t1 6 8
\t// begin inline asm
\t.loc\t1 6 8
\t@%p2 st.global.b16 [ %rd3 + 0 ], { %rs1 };

\t// end inline asm
\t.file\t1 "k.py"
'''


def test_inline_asm_blocks_take_their_first_location():
    """triton 3.8/3.9's PTX: an inline asm block's instructions take the block's location (its first .loc), not
    the line numbers counted up after it; the same reading as the 3.7 format's. Read by the old rule (every
    .loc), x's load would sit at 8:7, claimed by no TTIR access (the calibration's "unmatched")."""
    assert [a['loc'] for a in S.ptx_accesses(PTX_38)] == [('k.py', 3, 5), ('k.py', 4, 7), ('k.py', 6, 8)]
    args, unmatched = S.memory_accesses(TTIR, PTX_38)
    assert (args['x_ptr']['load_bytes'], args['x_ptr']['load_elems']) == (16, 8)
    assert (args['y_ptr']['store_bytes'], args['y_ptr']['store_elems']) == (2, 1)
    assert unmatched == []


def test_fp64_approximations_and_ptxas_lines():
    assert S.fp64_approx(PTX) == ['rsqrt.approx.f64 \t%fd2, %fd1;']
    log = ('ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]\n'
           'ptxas info    : Function properties for k\n'
           '    8 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads')
    assert S.ptxas_resources(log) == (40, 8, 12)
    # a noinline callee's own report counts too (registers: the most; spills: summed)
    callee = ('ptxas info    : Function properties for fold\n'
              '    0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n'
              'ptxas info    : Used 56 registers, used 0 barriers')
    assert S.ptxas_resources(log + '\n' + callee) == (56, 12, 16)


def _step(launches=6, act_bytes=6.0, forward=3):
    phase = dict(triton=3, aten=0, launches='k, k, k')
    return dict(case='c', setting='bf16', level='P2', forward=dict(phase, triton=forward), backward=phase,
                train=dict(triton=launches, aten=0, launches=launches, act_bytes_x=act_bytes))


def _variant(**kw):
    e = dict(kernel='k', constexprs={}, pointer_types=['bf16'], compiles=True, error=None, registers=32,
             spill_stores=0, spill_loads=0, fp64_approx=[], activation_args=['x_ptr'], unattributed_ptx=[],
             access={'x_ptr': dict(elt='bf16', load=True, store=False, load_bytes=16, load_elems=8,
                                   store_bytes=None, store_elems=None, single=0)})
    e.update(kw)
    return e


def test_each_check_fails_on_a_planted_violation():
    fn = types.SimpleNamespace(fn=types.SimpleNamespace(__module__='m', __name__='k', __qualname__='k'),
                               params=[types.SimpleNamespace(name='L', do_not_specialize=False)])
    clean = M.violations([_step()], {0: _variant()}, [])
    assert not any(clean.values()), clean
    scalar = _variant()
    scalar['access']['x_ptr'].update(load_bytes=2, load_elems=1)
    planted = {
        'recorded': ([_step(forward=0)], {}, []),
        'launches': ([_step(launches=7)], {}, []),
        'activation_bytes': ([_step(act_bytes=8.5)], {}, []),
        'compiles': ([], {0: _variant(compiles=False, error='CompilationError: x')}, []),
        'sizes_do_not_specialize': ([], {}, [fn]),
        'spills': ([], {0: _variant(spill_stores=8)}, []),
        'fp64_approx': ([], {0: _variant(fp64_approx=['rsqrt.approx.f64 %fd2, %fd1;'])}, []),
        'vector_access': ([], {0: scalar}, []),
    }
    for check, args in planted.items():
        found = M.violations(*args)
        assert [c for c, v in found.items() if v] == [check], (check, found)
    assert set(planted) | {'calibration'} == set(M.CHECKS)  # the calibration: compiled by the report itself


# --- the report at the FPN shapes -----------------------------------------------------------------------------
@pytest.fixture(scope='module')
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('sm90')
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['TRITON_CACHE_DIR'] = str(tmp / 'triton-cache')  # compiled here, not found in a cache
    env['PYTHONPATH'] = ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, 'benchmarks', 'sm90_report.py'), '--out-dir', str(tmp)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    with open(tmp / 'sm90_report.json') as f:
        return json.load(f)


def _check(report, name):
    found = report['violations'][name]
    assert not found, f'{M.CHECKS[name]}: {len(found)} violations\n' + '\n'.join(found[:40])


@pytest.mark.slow  # the report: ~150-210 s on 2 cores (compiles every variant for sm_90), shared by this module's tests
def test_report_covers_every_case_setting_and_level(report):
    s = report['settings']
    assert len(report['layers']) == len(s['cases']) * len(s['settings']) >= 14 * 7
    assert all(len(row['levels']) == len(s['levels']) == 7 for row in report['layers'])
    assert s['batch']['N256'] == 256  # a classification batch: the VJPs' sample blocks, dx's second stage
    per_level = dict(report['timing']['variants_per_level'])
    large = per_level.pop('N256')
    assert report['timing']['variants'] <= 1.2 * max(per_level.values()) + large  # the FPN levels share theirs


@pytest.mark.slow
@pytest.mark.parametrize('check', ['calibration', 'recorded', 'compiles', 'sizes_do_not_specialize'])
def test_every_variant_compiles_for_sm90(report, check):
    _check(report, check)


@pytest.mark.slow
def test_activation_accesses_are_vectors(report):
    _check(report, 'vector_access')


@pytest.mark.slow
def test_no_register_spills(report):
    _check(report, 'spills')


@pytest.mark.slow
def test_no_fp64_approximation(report):
    _check(report, 'fp64_approx')


@pytest.mark.slow
def test_at_most_6_launches_per_training_step(report):
    _check(report, 'launches')


@pytest.mark.slow
def test_at_most_8x_activation_bytes_per_training_step(report):
    _check(report, 'activation_bytes')
