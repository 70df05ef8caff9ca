"""Strict ``load_from`` / ``--resume`` / ``tools/test.py CHECKPOINT`` loads in any mmengine Runner."""
from mmengine.hooks import Hook

from ..checkpoint import check_load


class StrictLoadHook(Hook):
    """Refuse a Runner checkpoint that does not cover the model.

    mmengine's ``Runner.load_checkpoint`` (behind ``load_from``, ``resume`` and the codebases' test
    tools) loads with ``strict=False``: a checkpoint without BCN's ``running_mean``/``running_var`` or
    with a head of another shape only warns, and the model then runs with estimates at 0/1 or
    untrained weights. This hook sees the checkpoint in ``after_load_checkpoint``, just before the
    weights are copied in, and raises :class:`~normdense.checkpoint.CheckpointMismatchError` naming the
    missing, unexpected and shape-mismatched keys. ``allow_partial=True`` loads anyway and logs, at
    warning level, every tensor that stays at its initialization.

    It runs last (priority ``LOWEST``) so hooks that rewrite the checkpoint first (e.g. ``EMAHook``) are
    taken into account. ``tools/train.py`` and ``tools/test.py`` add it; other launchers can put
    ``dict(type='StrictLoadHook')`` in ``custom_hooks``.
    """
    priority = 'LOWEST'

    def __init__(self, allow_partial: bool = False):
        self.allow_partial = allow_partial

    def after_load_checkpoint(self, runner, checkpoint: dict) -> None:
        name = runner._load_from if getattr(runner, '_load_from', None) else 'the checkpoint'
        check_load(runner.model, checkpoint, name, allow_partial=self.allow_partial, logger=runner.logger)
