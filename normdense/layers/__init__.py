"""Plain nn.Module implementations, one file per paper method (registered in normdense/registry.py)."""
from ._estimate import EstimateRateMixin, mark_iteration, set_update_rate  # noqa: F401  (estimate mode, shared)
from ._fused import set_fused  # noqa: F401  (fused path on / off for every BCN, GN+PN, Unitization in a model)
