"""The drafting policies by name (`MethodSpec.drafting`): the registry the decoder builds its
policy from, so the policy modules never import the decoder (they see its settings as
`state.DecodeConfig` and its buffers through `state.DraftView`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.core.drafting import DraftPolicy
from runtime.core.dynamic_tree import DynamicTreePolicy
from runtime.core.static_tree import StaticTreePolicy
from runtime.core.jacobi import JacobiPolicy
from runtime.core.pjd import PJDPolicy
from runtime.config.method_options import Drafting

if TYPE_CHECKING:
    from runtime.core.state import DecodeConfig

POLICIES: dict[Drafting, type[DraftPolicy]] = {
    Drafting.NONE: DraftPolicy,  # AR: the root alone
    Drafting.STATIC: StaticTreePolicy,  # a drafter head over a static tree (sd chains, LANTERN++ trees)
    Drafting.DYNAMIC: DynamicTreePolicy,  # a drafter head over an EAGLE-2 dynamic tree (eagle2, ddd, lantern)
    Drafting.JACOBI: JacobiPolicy,  # no drafter: the target's own predictions over a window (sjd)
    Drafting.PJD: PJDPolicy,  # sjd's window plus lookahead rows below it in the same forward (pjd)
}


def make_policy(config: "DecodeConfig") -> DraftPolicy:
    """The policy of the loop's method (unbound: the loop binds it to its buffers)."""
    return POLICIES[config.spec.drafting](config)
