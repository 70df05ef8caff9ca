"""``NormSwitchRunner``: mmengine's Runner applying ``normdense_norm`` (the norm switch,
``normdense/norm_switch.py``) to the config it is built from, and finishing the built model (layer counts,
hard-coded layers listed or converted) before the optimizer exists.

Selected by ``runner_type = 'NormSwitchRunner'`` (``configs/_base_/norm_switch.py``; ``--norm`` of
tools/train.py and tools/test.py), which mmdet's, mmseg's and mmpretrain's own train.py/test.py honour
(they build ``cfg.runner_type`` through mmengine's ``RUNNERS``). Without ``normdense_norm`` it is the
plain Runner.
"""
import copy

from mmengine.runner import Runner

from .norm_switch import finish_model, switch_norm


class NormSwitchRunner(Runner):

    _pending = None  # the switch report of the config being built (from_cfg -> build_model)

    @classmethod
    def from_cfg(cls, cfg):
        spec = cfg.get('normdense_norm')
        if not spec:
            return super().from_cfg(cfg)
        cfg = copy.deepcopy(cfg)
        report = switch_norm(cfg, spec)
        NormSwitchRunner._pending = report
        try:
            return super().from_cfg(cfg)
        finally:
            NormSwitchRunner._pending = None

    def build_model(self, model):
        built = super().build_model(model)
        report, spec = NormSwitchRunner._pending, self.cfg.get('normdense_norm')
        if report is None or not spec or not isinstance(model, dict):
            return built
        NormSwitchRunner._pending = None
        built = finish_model(built, spec, report)
        self.normdense_switch = report
        self.logger.info('\n' + report.table())
        return built
