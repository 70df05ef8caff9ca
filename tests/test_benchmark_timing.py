"""benchmarks/_timing.py: operator counts, page-fault counts and the retained-malloc restart that the layer
benchmark reports."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from benchmarks._timing import RETAIN_MALLOC_ENV, count_ops, interleaved_times

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_count_ops_counts_kernels_not_views():
    gn = nn.GroupNorm(2, 4)
    x = torch.randn(2, 4, 3, 3, requires_grad=True)
    dy = torch.ones(2, 4, 3, 3)
    # GroupNorm's forward and backward are one kernel each (x.grad is None: stored, not added)
    assert count_ops(lambda: gn(x).backward(dy)) == 2
    assert count_ops(lambda: x.view(2, -1).t().unsqueeze(0).detach()) == 0
    assert count_ops(lambda: (x.detach() * 2 + 1).sum()) == 3


def test_interleaved_times_records_faults_per_call():
    faults = {}
    times = interleaved_times({'a': lambda: torch.ones(8), 'b': lambda: torch.zeros(8)}, repeats=3, warmup=0,
                              faults=faults)
    assert set(faults) == set(times) == {'a', 'b'}
    assert all(len(v) == 3 and all(isinstance(f, int) and f >= 0 for f in v) for v in faults.values())


@pytest.mark.skipif(platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc', reason='needs glibc')
def test_restart_with_retained_malloc_sets_the_tunables(tmp_path):
    script = tmp_path / 'child.py'
    script.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {ROOT!r})
        from benchmarks._timing import malloc_mode, restart_with_retained_malloc
        print('mode', malloc_mode(), sys.argv[1:], flush=True)
        restart_with_retained_malloc(sys.argv[1:])
        print('after', malloc_mode(), sys.argv[1:])
    '''))
    env = {k: v for k, v in os.environ.items() if k not in RETAIN_MALLOC_ENV}
    out = subprocess.run([sys.executable, str(script), '--x', '1'], env=env, capture_output=True, text=True,
                         check=True).stdout.split('\n')
    # the first process restarts itself once; the restarted one sees the tunables and goes on
    assert out[:3] == ["mode default ['--x', '1']", "mode retain ['--x', '1']", "after retain ['--x', '1']"]
