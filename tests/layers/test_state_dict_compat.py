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
    assert sorted(layer.state_dict()) == sorted(case['state'])
    layer.load_state_dict(case['state'], strict=True)
    with torch.no_grad():
        y = layer.eval()(SAVED['x'])
    torch.testing.assert_close(y, case['y'], rtol=0, atol=1e-12)
