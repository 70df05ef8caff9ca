"""benchmarks/norm_comparison.py end to end on a tiny schedule (the full run is a benchmark, not a test)."""
import json
import os
import os.path as osp
import subprocess
import sys

import pytest

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.mark.slow  # ~1-2 min on 2 shared cores: 6 Runner builds, trainings and evaluations
def test_norm_comparison_tiny_end_to_end(tmp_path):
    out, plot = tmp_path / 'out.json', tmp_path / 'plot.png'
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
    cmd = [sys.executable, osp.join(ROOT, 'benchmarks', 'norm_comparison.py'), '--tiny', '--seeds', '0,1',
           '--seg-norms', 'bn,bcn-ws', '--cls-norms', 'gn-ws', '--cls-batches', '1',
           '--data-dir', str(tmp_path / 'data'), '--work-dir', str(tmp_path / 'work'), '--out', str(out),
           '--plot', str(plot)]
    run = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result['tiny'] and 'BCN+WS > GN+WS > GN > BN' in result['paper_order']
    assert [(r['task'], r['norm'], r['seed'], r['batch']) for r in result['runs']] == [
        ('seg', 'bn', 0, 2), ('seg', 'bcn-ws', 0, 2), ('cls', 'gn-ws', 0, 1),
        ('seg', 'bn', 1, 2), ('seg', 'bcn-ws', 1, 2), ('cls', 'gn-ws', 1, 1)]
    assert all(0 <= r['value'] <= 100 and r['iters'] == 2 for r in result['runs'])
    # measured with the switch: each run's first summary line names the norm
    assert 'norm switch: bcn-ws' in result['runs'][1]['switched']
    summary = {(s['task'], s['norm']): s for s in result['summary']}
    assert summary[('seg', 'bn')]['seeds'] == 2 and summary[('seg', 'bn')]['min'] <= summary[('seg', 'bn')]['max']
    assert plot.stat().st_size > 1000
    assert '[norm_comparison] seg batch 2 BCN+WS: mean' in run.stdout
