"""Diagnostics from the papers: StatDiff (WS/BCN Eq. 35), SND (IterNorm Eq. 9-10), the EM-distance ICS
measure and its moment lower bound (Unitization Eq. 2-3, 6-7) and the power decomposition (PN Eq. 5);
plus the forward-hook recorder shared by ``NormDiagnosticsHook`` and ``tools/analyze_norms.py``.

This package imports only torch; ``normdense.analysis.report`` (the tool's logic) needs mmengine and
matplotlib and is imported on demand.
"""
from .ics import em_distance, f_nC, feature_samples, ics_moment_bound, wasserstein_1d
from .power import (POWER_TERMS, instance_moments, power_decomposition, power_decomposition_from_moments,
                    power_summary)
from .recorder import DIAGNOSTICS, LayerRecorder, check_diagnostics, select_modules
from .snd import batch_standardize, module_snd, snd
from .statdiff import channel_moments, statdiff, statdiff_from_moments

__all__ = [
    'statdiff', 'statdiff_from_moments', 'channel_moments', 'snd', 'module_snd', 'batch_standardize',
    'em_distance', 'wasserstein_1d', 'ics_moment_bound', 'f_nC', 'feature_samples', 'power_decomposition',
    'power_decomposition_from_moments', 'power_summary', 'instance_moments', 'POWER_TERMS', 'DIAGNOSTICS',
    'LayerRecorder', 'select_modules', 'check_diagnostics',
]
