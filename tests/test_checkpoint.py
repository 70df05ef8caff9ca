"""The torch.load allow-list for mmengine checkpoints stays exact: nothing else gets through."""
import collections
import os
import pickle

import pytest
import torch
from mmengine.logging import HistoryBuffer, MessageHub
from mmengine.runner import load_checkpoint

import normdense  # noqa: F401
from normdense.checkpoint import mmengine_checkpoint_globals


class Payload:
    """Stands for an arbitrary class a malicious checkpoint could pickle."""

    def __reduce__(self):
        return (os.system, ('echo pwned',))


class PlainObject:
    pass


def test_message_hub_with_numpy_history_loads_weights_only(tmp_path):
    hub = MessageHub.get_instance('normdense_test')
    for i in range(3):
        hub.update_scalar('train/loss', 1.0 / (i + 1))
    path = tmp_path / 'ckpt.pth'
    torch.save({'message_hub': hub.state_dict(), 'meta': {'iter': 3}}, path)
    loaded = torch.load(path)  # weights_only=True is torch's default
    buffer = loaded['message_hub']['log_scalars']['train/loss']
    assert isinstance(buffer, HistoryBuffer) and buffer.current() == pytest.approx(1 / 3)
    assert buffer.statistics('mean') == pytest.approx((1 + 1 / 2 + 1 / 3) / 3)
    unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    allowed = {name or f'{obj.__module__}.{obj.__qualname__}' for obj, name in mmengine_checkpoint_globals()}
    assert unsafe <= allowed


@pytest.mark.parametrize('payload', [Payload(), PlainObject()])
def test_arbitrary_classes_are_still_refused(tmp_path, payload):
    path = tmp_path / 'evil.pth'
    torch.save({'state_dict': {}, 'meta': payload}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(torch.nn.Linear(1, 1), str(path))


def test_getattr_is_restricted_to_history_buffer_statistics(tmp_path):
    class Evil:
        def __reduce__(self):  # a general getattr walks from an allowed class to anything (eval, os)
            return (getattr, (collections.OrderedDict, '__init__'))
    path = tmp_path / 'evil_getattr.pth'
    torch.save({'x': Evil()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path)
