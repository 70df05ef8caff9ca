"""scripts/gpu_check.sh: its arguments, and the one line it prints where it cannot run (here: no GPU, or an
interpreter without torch), run as a subprocess. The GPU path itself runs on a GPU machine only (docs/gpu.md).
scripts/gpu_step.py, the program it runs under compute-sanitizer, refuses in one line without a GPU too."""
import os
import os.path as osp
import subprocess
import sys

import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SCRIPT = osp.join(ROOT, 'scripts', 'gpu_check.sh')


def run(*args, python=sys.executable, cwd=ROOT):
    env = dict(os.environ, PYTHON=python)
    return subprocess.run(['bash', SCRIPT, *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def one_line(proc):
    text = (proc.stdout + proc.stderr).strip()
    assert text and '\n' not in text, f'expected one line, got:\n{proc.stdout}{proc.stderr}'
    return text


@pytest.mark.parametrize('args', [(), ('a', 'b'), ('', )], ids=['none', 'two', 'empty'])
def test_wrong_arguments_exit_2_with_the_usage(args, tmp_path):
    proc = run(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert 'usage: scripts/gpu_check.sh RESULTS_DIR' in one_line(proc) and proc.stdout == ''
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_help_and_a_file_as_results_dir(tmp_path):
    proc = run('--help')
    assert proc.returncode == 0 and proc.stdout.startswith('usage: scripts/gpu_check.sh RESULTS_DIR')
    target = tmp_path / 'file'
    target.write_text('x')
    proc = run(target)
    assert proc.returncode == 2 and 'is not a directory' in one_line(proc)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message shown without a GPU')
def test_without_gpu_one_line_names_the_gpu(tmp_path):
    out = tmp_path / 'results' / 'nested'  # created, also from another working directory
    proc = run(out, cwd=tmp_path)
    assert proc.returncode == 1
    line = one_line(proc)
    assert line.startswith('gpu_check: missing: a CUDA GPU') and f'torch {torch.__version__}' in line, line
    assert proc.stdout == ''
    assert sorted(p.name for p in out.iterdir()) == ['summary.md']  # the reason, for whoever collects the folder
    assert 'missing: a CUDA GPU' in (out / 'summary.md').read_text()


def test_without_torch_or_python_one_line(tmp_path):
    nosite = tmp_path / 'python-without-torch'  # the same interpreter without its site-packages
    nosite.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    nosite.chmod(0o755)
    proc = run(tmp_path / 'r', python=nosite)
    assert proc.returncode == 1 and one_line(proc).startswith('gpu_check: missing: torch in '), proc.stderr
    assert 'ModuleNotFoundError' in proc.stderr
    proc = run(tmp_path / 'r', python=tmp_path / 'no-such-python')
    assert proc.returncode == 1 and one_line(proc).startswith('gpu_check: missing: '), proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the message shown without a GPU')
def test_gpu_step_refuses_without_gpu_in_one_line():
    proc = subprocess.run([sys.executable, osp.join(ROOT, 'scripts', 'gpu_step.py')], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 1 and one_line(proc) == 'gpu_step.py: no GPU (torch.cuda.is_available() is False)'


@pytest.mark.slow  # ~25 s: GN+PN's kernels in the interpreter, 10 s a step on a P7 map
@pytest.mark.skipif(os.environ.get('TRITON_INTERPRET') != '1', reason='the Triton kernels on CPU tensors: the interpreter')
def test_grad_diagnosis_runs_a_case_on_cpu_tensors():
    """scripts/gpu_grad_diag.py, the GPU run's first step, on a P7 map in the interpreter (one step, one repeat):
    the record the GPU run writes (JSON-able), the worst elements with their pre-activation, the kink count, and
    the (sample, group) slice it saves."""
    import json
    sys.path.insert(0, osp.join(ROOT, 'scripts'))
    import gpu_grad_diag as diag
    res, (_, worst) = diag.run_case('GNPN-relu', 'P7', 'fp16', 'cpu', 1, 'off', device='cpu', n_steps=1, repeats=1)
    json.dumps(res)
    assert res['passed'] and len(res['steps']) == 1 and res['case'] == 'GNPN-relu P7 fp16 cpu:1 off'
    step = res['steps'][0]
    assert step['bitwise_repeatable'] == [True] and len(step['top']) == diag.TOP
    assert step['triton'] <= step['bound'] and step['top'][0]['z64'] is not None
    assert step['near_kink_elements'] == 0 and step['worst_near_kink'] is False  # drawn off the kinks
    assert worst['x'].shape == worst['dy'].shape == (1, 8, 7, 10) and worst['x'].dtype == torch.float16
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, osp.join(ROOT, 'scripts', 'gpu_grad_diag.py'), 'out'],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 1 and one_line(proc).startswith('gpu_grad_diag.py: no GPU')
