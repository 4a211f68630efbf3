"""The drafter attends to the condition positions it was trained with.

LANTERN's drafters (and `runtime train drafter`'s) are trained with every condition position
visible, padded caption positions included (token id 0 there, paired with the target's hidden
state); a drafter config records it as `condition_context` ("all", the default, or "valid").
"""

from dataclasses import replace

import pytest

from runtime.core import Decoder, MethodSpec, SamplingParams
from runtime.utils.errors import UserError
from runtime.models.loading import drafter_config_from_json, drafter_config_to_json
from tiny_models import caption, tiny_pair


@pytest.mark.parametrize("method", ["eagle2", "lantern++"])
def test_the_drafter_cache_masks_padded_captions_only_for_a_valid_context_drafter(method):
    target, drafter = tiny_pair(model_type="t2i")
    cond, mask = caption(target)
    cls = target.config.cls_token_num
    spec = MethodSpec(method, SamplingParams(greedy=True, cfg=1.0), depth=2, top_k_draft=2, total_tokens=5,
                      tree="chain2", lantern_lambda=1.0)
    seen = {}
    for context in ("all", "valid"):
        drafter.config = replace(drafter.config, condition_context=context)
        dec = Decoder(target, drafter, spec)
        dec.prefill(cond, mask, seed=0)
        seen[context] = dec.policy.dcache.prefix_valid[0, :cls]
        # the target's own cache masks the padding either way (LlamaGen is trained so)
        assert dec.cache.prefix_valid[0, :cls].tolist() == mask[0].tolist()
        tokens, _ = dec.generate_one(cond, mask, seed=0)
        assert tokens.numel() == target.config.block_size
    assert seen["all"].all()
    assert seen["valid"].tolist() == mask[0].tolist()


def test_condition_context_round_trips_through_config_json_and_defaults_to_all():
    _, drafter = tiny_pair(model_type="t2i")
    for context in ("all", "valid"):
        cfg = replace(drafter.config, condition_context=context)
        assert drafter_config_from_json(drafter_config_to_json(cfg)) == cfg
    lantern_style = drafter_config_to_json(drafter.config)
    del lantern_style["condition_context"]  # LANTERN's released config.json has no such field
    assert drafter_config_from_json(lantern_style).condition_context == "all"
    with pytest.raises(UserError, match="condition_context"):
        drafter_config_from_json(dict(lantern_style, condition_context="some"))
