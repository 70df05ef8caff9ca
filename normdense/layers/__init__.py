"""Plain nn.Module implementations, one file per paper method (registered in normdense/registry.py)."""
from ._estimate import EstimateRateMixin, set_update_rate  # noqa: F401  (estimate-mode rate, shared)
from ._fused import set_fused  # noqa: F401  (fused path on / off for every BCN, GN+PN, Unitization in a model)
