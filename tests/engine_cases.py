"""The engine layers' test cases, made from the layers' declarations (normdense/layers/declare.py): normdense's
own, and any that a test module declared (tests/layers/test_new_layer.py) once pytest's collection imported it.
The tests that loop over them at run time (the host-path and launch-key tests) pick a new layer up unedited."""
import functools
import inspect

from normdense.layers import declarations
from normdense.layers._statnorm import StatNorm2d


def engine_cases(channels: int, groups: int, **options) -> dict:
    """{case name: a function making that layer with ``channels`` channels}: every declared engine layer's cases,
    ``num_groups=groups`` where the constructor takes it (a case may set its own), ``options`` (``backend=``) added."""
    cases = {}
    for decl in declarations():
        if not issubclass(decl.cls, StatNorm2d):
            continue
        takes_groups = 'num_groups' in inspect.signature(decl.cls).parameters
        for name, kwargs in decl.cases.items():
            kwargs = {**({'num_groups': groups} if takes_groups else {}), **kwargs, **options}
            cases[name] = functools.partial(decl.cls, channels, **kwargs)
    return cases
