"""The compiled-only fast forms of normdense.kernels.activations (``FAST``), read in their sm_90 PTX without a
GPU (tests/kernels/activation_ptx.py, compiled twice: as the GPU gets it and with ``FAST`` off, i.e. the
portable forms the interpreter runs): every activation compiles in float32 and float64; in float32 each fast
form takes the instructions chosen for it (libdevice's inlined expm1/log1p/tanh, or one exp and one division)
and fewer instructions than the portable form, and the activations without a fast form compile to the same
PTX; in float64 nothing approximate enters but libdevice's own refined seeds. Accuracy on a GPU:
tests/cuda/test_fast_activations.py."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (activation, part) -> the libdevice function inlined, or None for the one-exp-one-division forms
FAST_FORMS = {
    ('elu', 'forward'): 'expm1', ('celu', 'forward'): 'expm1', ('selu', 'forward'): 'expm1',
    ('softplus', 'forward'): 'log1p', ('tanh', 'forward'): 'tanh',
    ('mish', 'forward'): None, ('mish', 'grad'): None, ('tanh', 'grad'): None, ('gelu_tanh', 'grad'): None,
}
# the approximate instructions libdevice's double functions use exactly: a reciprocal seed that Newton steps
# refine, and 2^k of an integer k
LIBDEVICE_FP64_SEEDS = {'rcp.approx.ftz.f64', 'ex2.approx.ftz.f32'}
# one-exp-one-division forms whose portable form the compiler itself may bring to one exp and one division: the
# tanh-gelu derivative (its two tanh of the same argument: two exps and two divisions in triton 3.7's PTX, one
# and one in 3.8's and 3.9's, whose LLVM merges them; 33 instructions against the fast form's 31 there)
MERGED_BY_THE_COMPILER = {('gelu_tanh', 'grad')}
N_ACTIVATIONS = 14


def _compile_both(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}
    env['PYTHONPATH'] = ROOT
    script = os.path.join(ROOT, 'tests', 'kernels', 'activation_ptx.py')
    procs = {}
    for mode in ('fast', 'portable'):
        env['TRITON_CACHE_DIR'] = str(tmp_path / mode)  # compiled here, not found in a cache
        procs[mode] = subprocess.Popen([sys.executable, script] + (['--portable'] if mode == 'portable' else []),
                                       env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-4000:]
        out[mode] = json.loads(stdout)
    return out['fast'], out['portable']


def _counts(stats, *opcodes):
    return sum(stats['opcodes'].get(op, 0) for op in opcodes)


@pytest.mark.slow
def test_fast_forms_in_the_sm90_ptx(tmp_path):
    fast, portable = _compile_both(tmp_path)
    assert not portable['FAST']
    assert set(fast['variants']) == set(portable['variants'])
    assert len(fast['variants']) == N_ACTIVATIONS * 2 * 2  # every id, fp32 and fp64, act_forward and act_grad
    problems = [] if fast['FAST'] else ['activations.FAST is off in a compiling process']
    for key, f in sorted(fast['variants'].items()):
        p = portable['variants'][key]
        dtype, name, part = key.split()
        if (name, part) not in FAST_FORMS:
            if f['text'] != p['text']:
                problems.append(f'{key}: no fast form, yet its PTX differs from the portable one')
            continue
        lib = FAST_FORMS[name, part]
        if lib is not None and not f['libdevice'].get(lib):
            problems.append(f'{key}: no inlined libdevice {lib} ({f["libdevice"]})')
        if p['libdevice']:
            problems.append(f'{key}: the portable form inlines libdevice {p["libdevice"]}')
        if dtype == 'fp32':
            if f['instructions'] >= p['instructions']:
                problems.append(f'{key}: {f["instructions"]} PTX instructions, portable {p["instructions"]}')
            if lib is None:  # one exp (ex2.approx) and one division, where the portable form takes more
                exp_div = [(_counts(s, 'ex2.approx.f32'), _counts(s, 'div.full.f32')) for s in (f, p)]
                fewest = 2 if (name, part) in MERGED_BY_THE_COMPILER else 3
                if exp_div[0] != (1, 1) or sum(exp_div[1]) < fewest:
                    problems.append(f'{key}: (exp, division) {exp_div[0]}, portable {exp_div[1]}')
    for key, f in sorted(fast['variants'].items()):
        if key.startswith('fp64'):
            approx = {op for op in f['opcodes'] if '.approx' in op or op.startswith(('div.full', 'tanh'))}
            divisions = {op for op in f['opcodes'] if op.startswith('div')}
            if not approx <= LIBDEVICE_FP64_SEEDS or not divisions <= {'div.rn.f64'}:
                problems.append(f'{key}: approximate float64 arithmetic {sorted(approx | divisions)}')
    assert not problems, '\n'.join(problems)
