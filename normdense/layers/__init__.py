"""Plain nn.Module implementations, one file per paper method (registered in normdense/registry.py)."""
