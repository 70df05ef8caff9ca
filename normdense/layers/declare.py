"""One declaration per layer: what the rest of normdense needs to know of it, written once, in the layer's file.

The tables that list normdense's layers are made from these declarations, never written by hand: mmengine's
``MODELS`` names (``normdense/registry.py``), the norm switch's choices and configs (``norms.py``,
``norm_switch.py``), the checkpoint's norm detection (``checkpoint.py``), the optimizer's norm classes
(``optim.py``), the conversion tools' ``--norm`` names (``convert/spec.py``) and the engine tests' layer cases
(tests/kernels/test_host_path.py, test_launch.py)::

    @declare('MyNorm', state_keys=('my_buffer', ), cases={'batch': dict(mode='batch')})
    class MyNorm2d(StatNorm2d):
        ...

A layer file imports this module and nothing above ``layers/``; the tables import the layers (their
``layers/__init__.py`` import runs the declarations).
"""
from typing import Dict, NamedTuple, Optional, Tuple

__all__ = ['NormDeclaration', 'Switch', 'declare', 'declarations']


class Switch(NamedTuple):
    """A norm-switch choice (``tools/train.py --norm NAME``): the ``norm_cfg`` put into every slot (``groups``:
    the switch's group policy, ``num_groups`` / ``channels_per_group``, is added), the ``conv_cfg`` type (None:
    plain convs) and the custom hooks the norm needs."""
    name: str
    norm: dict
    groups: bool = False
    conv: Optional[str] = None
    hooks: Tuple[str, ...] = ()


class NormDeclaration(NamedTuple):
    """What normdense knows of a layer class ``cls``.

    ``name``: its mmengine ``MODELS`` name (``norm_cfg=dict(type=name)``); ``switches``: the norm-switch choices
    it makes; ``state_keys``: state-dict leaves (module suffixes) that only this norm has, which identify a
    checkpoint of it as ``state_name`` (strongest first within the layer); ``convert``: its ``--norm`` name in the
    checkpoint conversion tools, or None; ``decays_as_norm``: mmengine's ``norm_decay_mult`` must be taught it
    (a layer with affine parameters that is not an ``nn.GroupNorm`` / ``_BatchNorm`` subclass, which mmengine
    recognises itself); ``cases``: for an engine layer (a ``StatNorm2d``), the test and benchmark cases, name ->
    constructor keywords after the channel count (``num_groups`` is added where the constructor takes it)."""
    cls: type
    name: str
    switches: Tuple[Switch, ...] = ()
    state_keys: Tuple[str, ...] = ()
    state_name: Optional[str] = None
    convert: Optional[str] = None
    decays_as_norm: bool = False
    cases: Dict[str, dict] = {}


_DECLARED: Dict[tuple, NormDeclaration] = {}  # (module, qualified name) -> declaration


def declare(name: str, **fields):
    """A class decorator: declares the class it decorates (:class:`NormDeclaration`'s fields by keyword); a name
    or state key another class declared already raises (a class defined again, as by a module reload, replaces its
    declaration)."""
    def decorate(cls):
        decl = NormDeclaration(cls=cls, name=name, **fields)
        ident = (cls.__module__, cls.__qualname__)
        for other_ident, other in _DECLARED.items():
            if other_ident == ident:
                continue
            if other.name == name:
                raise ValueError(f'{cls.__name__}: the name {name!r} is declared by {other.cls.__name__} already')
            clash = set(other.state_keys) & set(decl.state_keys)
            if clash:
                raise ValueError(f'{cls.__name__}: state keys {sorted(clash)} are declared by {other.cls.__name__}')
        _DECLARED[ident] = decl
        return cls
    return decorate


def declarations() -> Tuple[NormDeclaration, ...]:
    """Every declared layer, in the order of declaration (normdense's own once ``normdense.layers`` is imported)."""
    return tuple(_DECLARED.values())
