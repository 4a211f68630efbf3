"""Changing how a layer's matmul runs by swapping its class, and back.

A backend that runs some `nn.Linear` layers differently (prepacked weights, a compiled reduction)
gives each such layer a subclass of its own class whose `forward` does it: parameters, state-dict
keys, hooks and the owner's attribute stay as they were, and `restore_class` undoes it. A
subclass of `nn.Linear` (`FusedLinear`) keeps its own `forward`; the variant's matmul runs where
that calls `nn.Linear.forward` (`super().forward`), because the made class puts the layer's class
first in its MRO and the variant after it.
"""

from __future__ import annotations

from torch import nn

# (layer class, variant) -> the class made for them; made class -> (layer class, variant)
_MADE: dict[tuple[type, type], type] = {}
_ORIGINAL: dict[type, tuple[type, type]] = {}


def variant_class(cls: type, variant: type) -> type:
    """`cls` running `variant`'s matmul: `variant` itself for `nn.Linear`, else a class named
    `<variant prefix><cls name>` (PackedLinear + FusedLinear -> PackedFusedLinear), made once."""
    if cls is nn.Linear:
        _ORIGINAL.setdefault(variant, (nn.Linear, variant))
        return variant
    key = (cls, variant)
    if key not in _MADE:
        prefix = variant.__name__.removesuffix("Linear")
        made = type(f"{prefix}{cls.__name__}", (cls, variant), {"__module__": __name__})
        globals()[made.__name__] = made  # importable by name, so a swapped model still pickles
        _MADE[key], _ORIGINAL[made] = made, key
    return _MADE[key]


def swap_class(layer: nn.Linear, variant: type) -> None:
    """Make `layer` run `variant`'s matmul (idempotent)."""
    if not isinstance(layer, variant):
        layer.__class__ = variant_class(type(layer), variant)


def restore_class(layer: nn.Module, variant: type) -> bool:
    """Give a layer that runs `variant`'s matmul its own class back; whether it did."""
    original = _ORIGINAL.get(type(layer))
    if original is None or original[1] is not variant:
        return False
    layer.__class__ = original[0]
    return True
