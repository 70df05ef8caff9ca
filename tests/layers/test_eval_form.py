"""normdense/layers/eval_form.py: the modules of a layer's inference form."""
import warnings

import pytest
import torch

from normdense.layers.eval_form import ChannelAffine


def test_eval_form_affine_records_no_shape_check_into_a_traced_graph():
    """The eval form's frozen affine is built for its layer's channels: tracing it (tools/deploy.py, the
    TorchScript exporter) records no Python check of the input's shape (a TracerWarning per layer before)."""
    aff = ChannelAffine.of(torch.rand(6), torch.rand(6), torch.float32, 6)
    x = torch.randn(2, 6, 3, 3)
    with warnings.catch_warnings():
        warnings.simplefilter('error', torch.jit.TracerWarning)
        traced = torch.jit.trace(aff, x)
    torch.testing.assert_close(traced(x), aff(x))
    assert not aff.training and not any(p.requires_grad for p in aff.parameters())


def test_config_affine_checks_its_input_in_one_line():
    with pytest.raises(ValueError, match=r'ChannelAffine\(6\) expects \(N, 6, \.\.\.\) input, got shape \(2, 5, 3\)'):
        ChannelAffine(6)(torch.randn(2, 5, 3))
