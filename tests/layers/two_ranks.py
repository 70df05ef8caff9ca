"""Runs a worker module as two gloo processes (``python -m MODULE RANK INIT_FILE OUT_DIR``) for the layer
tests and returns what each rank saved as ``OUT_DIR/rank{r}.pth``; a hang fails instead of blocking."""
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_two_ranks(tmp_path, module, *extra):
    """``extra``: arguments after OUT_DIR."""
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, '-m', module, str(r), str(tmp_path / 'init'), str(tmp_path), *extra],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in (0, 1)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0].decode(errors='replace'))
        except subprocess.TimeoutExpired:  # a hang fails the test instead of blocking the suite
            for q in procs:
                q.kill()
            pytest.fail('a rank hung: the ranks issued different collectives (one was skipped)')
    assert all(p.returncode == 0 for p in procs), '\n'.join(o[-3000:] for o in outputs)
    return [torch.load(tmp_path / f'rank{r}.pth') for r in (0, 1)]
