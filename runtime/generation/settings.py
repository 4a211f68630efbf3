"""Method settings and where they come from: flag > hardware profile > the model's recommended
settings (the demo bundle's manifest; for official LlamaGen checkpoints the defaults of
LlamaGen's own sampling scripts, by model kind) > the code default; `--method auto`."""


from __future__ import annotations

import logging
from typing import Any, Sequence

from runtime.core import MethodSpec, SamplingParams
from runtime.core.tree import load_tree
from runtime.utils.errors import UserError
from runtime.generation.loading import LoadedModel
from runtime.config.method_options import FLAG_METHODS, METHOD_TABLE, OPTION_TYPES, SAMPLING_KEYS, Drafting, RelaxKind

_log = logging.getLogger(__name__)

_SPEC_KEYS = tuple(OPTION_TYPES)  # the MethodSpec fields a flag, profile or model can set


def parse_proactive(text: str | None) -> tuple[int, int] | None:
    """`--proactive K,D` (or KxD; "off"/"none" = no tree) -> (K, D)."""
    if text is None or text.strip().lower() in ("off", "none", ""):
        return None
    parts = text.replace("x", ",").split(",")
    try:
        k, d = (int(p) for p in parts)
    except ValueError:
        raise UserError(f"--proactive {text!r}: expected K,D such as 3,2 (K children per node, D levels)") from None
    return k, d


_FLAG_NAMES = {"greedy": "--greedy/--sample"}


def _layers(flags: dict[str, Any], profile: Any, recommended: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(source kind, settings) from highest to lowest precedence: "flag", "profile", "model"."""
    pinned = profile.method.pinned() if profile is not None else {}
    if profile is not None:
        pinned.setdefault("tree", profile.tree.name)
    return [("flag", flags), ("profile", pinned), ("model", recommended)]


def _source_of(key: str, layers: list[tuple[str, dict[str, Any]]]) -> str:
    """"flag", "profile", "model" or "default": where the setting `key` comes from."""
    return next((kind for kind, values in layers if values.get(key) is not None), "default")


AUTO = "auto"


def auto_method(profile: Any, occupancy: int, flags: dict[str, Any], memory_bound: bool = False) -> str:
    """`--method auto`: the lossless method the profile's `[auto]` table names for `occupancy`
    images decoding together (what `runtime tune` measured fastest there); for a `memory_bound`
    model, its `memory_bound` table where it has one."""
    table = getattr(profile, "auto", None)
    if table is None:
        raise UserError(f"--method auto needs a profile with an [auto] table (profile {getattr(profile, 'name', '?')} "
                        "has none); write one with runtime tune --out profiles/NAME.toml, then --profile-name NAME")
    for key in ("lantern_delta", "lantern_lambda", "relax_rule"):
        if flags.get(key) is not None:
            raise UserError(f"--{key.replace('_', '-')} relaxes acceptance, and --method auto picks lossless methods "
                            "only; drop it or name the method")
    return table.for_model(memory_bound).method_for(occupancy)


def resolve_spec(method: str | None, flags: dict[str, Any], profile: Any, recommended: dict[str, Any],
                 run_methods: Sequence[str] | None = None, lossless: bool = False) -> MethodSpec:
    """MethodSpec from flag > profile > model recommendation > default. `flags` None = unset.

    A cfg_interval >= 0 without guidance (cfg <= 1) would do nothing and is refused, and so
    is a method flag that none of `run_methods` (default: this method) reads. `lossless`: the
    relaxation is turned off (what `--method auto` runs), except lantern++'s where the profile has
    a `[quality]` table (`runtime tune --quality-budget`: a relaxation measured within a budget). sjd is exact
    unless --lantern-delta or --lantern-lambda is given as a flag (the model's recommended
    relaxation is for its drafter methods).
    """
    layers = _layers(flags, profile, recommended)

    def pick(key: str, default: Any) -> Any:
        return next((values[key] for _, values in layers if values.get(key) is not None), default)

    name = method or (profile.method.name if profile is not None else None) or recommended.get("method") or "lantern++"
    users = set(run_methods or [name])
    for key, readers in FLAG_METHODS.items():
        if flags.get(key) is not None and not users & readers:
            raise UserError(f"--{key.replace('_', '-')} does nothing for --method {'/'.join(sorted(users))} "
                            f"(it is read by {', '.join(sorted(readers))}); drop it")
    base = MethodSpec()
    sampling = SamplingParams(**{k: pick(k, getattr(SamplingParams(), k)) for k in SAMPLING_KEYS})
    values = {k: pick(k, getattr(base, k)) for k in _SPEC_KEYS}
    values["proactive"] = parse_proactive(values["proactive"]) if isinstance(values["proactive"], str) else values["proactive"]
    decl = METHOD_TABLE[name] if name in METHOD_TABLE else None  # an unknown name: MethodSpec refuses it
    if decl is not None and decl.chooses_relaxation:
        given = [k for k in ("lantern_delta", "lantern_lambda") if flags.get(k) is not None]
        if len(given) == 2:
            raise UserError(f"{name} takes one relaxation: --lantern-delta (additive) or --lantern-lambda "
                            "(multiplicative), not both")
        values["relax"] = {"lantern_delta": "delta", "lantern_lambda": "lambda"}[given[0]] if given else "none"
        if not given and flags.get("relax_rule") is not None:
            raise UserError("--relax-rule does nothing for exact sjd; give --lantern-delta or --lantern-lambda "
                            "too, or drop it")
        if values["accept"] != "grouped":
            for key in ("group_window", "group_gap", "group_dist"):
                if flags.get(key) is not None:
                    raise UserError(f"--{key.replace('_', '-')} does nothing without --accept grouped; drop it")
    if lossless:  # --method auto: the method's exact rule (lantern++ over its tree at lambda 1) ...
        values.update(lantern_lambda=1.0, lantern_delta=0.0)
        if decl is not None and decl.chooses_relaxation:
            values["relax"] = "none"
        quality = getattr(profile, "quality", None)
        if decl is not None and decl.relaxation == RelaxKind.LAMBDA and quality is not None:  # ... or the one tune measured within a quality budget
            values.update(lantern_lambda=quality.lantern_lambda, relax_rule=quality.relax_rule)
    spec = MethodSpec(method=name, sampling=sampling, **values)
    if sampling.cfg_interval >= 0 and not sampling.uses_cfg:
        where = {"flag": "--cfg-interval", "profile": f"profile {getattr(profile, 'name', '?')} cfg_interval",
                 "model": "the model's recommended cfg_interval"}[_source_of("cfg_interval", layers)]
        raise UserError(f"{where} {sampling.cfg_interval} does nothing without classifier-free guidance "
                        f"(cfg {sampling.cfg:g}); give --cfg above 1 or drop the cfg interval")
    if spec.drafting == Drafting.STATIC:
        load_tree(spec.tree_spec)  # unknown tree or malformed file: fail before any work
    _log.debug("method %s resolved: %s", name, spec)
    return spec


def sampling_sources(flags: dict[str, Any], profile: Any, loaded: LoadedModel,
                     spec: MethodSpec | None = None) -> dict[str, str]:
    """Where each sampling setting `resolve_spec` picks comes from, for result files:
    {"cfg": "flag (--cfg)", "top_k": "model default (LlamaGen sample_c2i.py)", ...}; with `spec`,
    also every method setting the method records (tree, lantern_k, lantern_lambda, depth, ...)."""
    layers = _layers(flags, profile, loaded.recommended)

    def label(key: str) -> str:
        kind = _source_of(key, layers)
        if kind == "flag":
            return f"flag ({_FLAG_NAMES.get(key, '--' + key.replace('_', '-'))})"
        if kind == "profile":
            return f"profile {profile.name}"
        return loaded.recommended_source if kind == "model" else "default"

    keys = SAMPLING_KEYS + (tuple(k for k in _SPEC_KEYS if k in spec.describe()) if spec is not None else ())
    return {key: label(key) for key in keys}
