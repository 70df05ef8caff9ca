"""Checkpoints of the layers from before the engine redesign (issue 37) load into today's layers: the same
parameter and buffer names (strict load), and the same eval output in float64. The file was written by
``tests/fixtures/make_statnorm_state.py`` with the code of that time."""
import os

import pytest
import torch

from tests.fixtures.make_statnorm_state import CASES

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'fixtures', 'statnorm_state.pt')
SAVED = torch.load(FIXTURE)


@pytest.mark.parametrize('name', sorted(CASES))
def test_old_state_dict_loads_and_computes_the_same(name):
    case = SAVED['cases'][name]
    layer = CASES[name]().double()
    # the same names, plus the num_batches_tracked that BCN keeps since issue 37 (filled with 0 on loading)
    assert sorted(set(layer.state_dict()) - {'num_batches_tracked'}) == sorted(set(case['state']) -
                                                                                {'num_batches_tracked'})
    layer.load_state_dict(case['state'], strict=True)
    if name.startswith('bcn'):
        assert int(layer.num_batches_tracked) == 0
    with torch.no_grad():
        y = layer.eval()(SAVED['x'])
    torch.testing.assert_close(y, case['y'], rtol=0, atol=1e-12)


@pytest.mark.parametrize('name', ['bcn_estimate', 'bcn_batch'])
def test_old_bcn_state_without_metadata_loads_strictly(name):
    """An old BCN state dict rebuilt as a plain dict (a converted checkpoint: no version metadata) lacks
    num_batches_tracked and loads strictly (0); a state dict of today's layer keeps its count."""
    old = dict(SAVED['cases'][name]['state'])
    assert 'num_batches_tracked' not in old
    layer = CASES[name]().double()
    layer.num_batches_tracked.fill_(5)
    layer.load_state_dict(old, strict=True)
    assert int(layer.num_batches_tracked) == 0
    layer.num_batches_tracked.fill_(7)
    again = CASES[name]().double()
    again.load_state_dict(layer.state_dict(), strict=True)
    assert int(again.num_batches_tracked) == 7
