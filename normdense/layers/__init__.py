"""Plain nn.Module implementations, one file per paper method (registered in normdense/registry.py)."""
from ._estimate import EstimateRateMixin, mark_iteration, set_update_rate  # noqa: F401  (estimate mode, shared)
from ._statnorm import StatNorm2d, set_fused  # noqa: F401  (the engine of BCN, GN+PN, Unitization; fused on / off)
