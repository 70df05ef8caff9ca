"""The suite's own guards (tests/conftest.py) catch what they name."""


def test_the_state_guard_sees_every_variable_it_names(monkeypatch):
    """tests/conftest.py fails a test that leaves process-wide state changed: each variable it names, the backend
    selection first, shows in the state it compares."""
    from tests.conftest import _ENV, _process_state
    assert 'NORMDENSE_BACKEND' in _ENV
    for name in _ENV:
        before = _process_state()
        monkeypatch.setenv(name, (before['env'][name] or '') + '-changed')
        assert _process_state() != before, name
        monkeypatch.undo()
        assert _process_state() == before
