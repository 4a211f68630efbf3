"""Nothing outside `runtime/core/` reaches a private name of the decoder: tune, selfcheck, the
projection and the step timing use its public steps (`DecodeSteps` docstring)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private_names() -> set[str]:
    """Private attributes and methods the decoder defines (`def _x` or `self._x = ...`), its
    slot API (decoder.py) and its steps (steps.py)."""
    text = "".join((ROOT / "runtime" / "core" / name).read_text() for name in ("decoder.py", "steps.py"))
    names = set(re.findall(r"def (_[a-z][a-z0-9_]*)\(", text))
    names |= set(re.findall(r"self\.(_[a-z][a-z0-9_]*)\s*(?::[^=\n]+)?=", text))
    return names


def test_no_private_decoder_name_outside_core():
    names = _private_names()
    assert {"_measure_law", "_iteration"} <= names  # the scan finds them
    found = []
    for path in [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        if (ROOT / "runtime" / "core") in path.parents:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            for name in re.findall(r"(?<!self)\.(_[a-z][a-z0-9_]*)\b", line):
                if name in names:
                    found.append(f"{path.relative_to(ROOT)}:{i}: .{name}")
    assert not found, "\n".join(found)


def test_method_names_are_declared_once():
    """The declared rows are the methods: one table and one list of names (`runtime.config.method_options`),
    which the core, the profiles and the CLI take as they are."""
    from runtime import core
    from runtime.config import profiles
    from runtime.cli import options
    from runtime.core import methods
    from runtime.config.method_options import METHOD_DECLS, METHOD_TABLE, METHODS

    assert METHODS == tuple(d.name for d in METHOD_DECLS) == tuple(METHOD_TABLE)
    assert core.METHODS is METHODS and methods.METHOD_TABLE is METHOD_TABLE and profiles.METHODS is METHODS
    assert options.METHODS is METHODS
    assert "sjd" in METHODS and set(profiles.AUTO_METHODS) == set(METHODS) - {"lantern", "cool-sd", "cool-eagle2"}


# imports of another module's underscored names still allowed, each with its reason (the
# reference generator registers the commands as the app does)
PRIVATE_IMPORTS_ALLOWED = {("runtime/cli/reference.py", "_register")}


def test_no_module_imports_another_modules_private_names():
    """`from runtime.x import _name` outside runtime.x is a private helper used as an API: move
    it where both can use it under a public name (runtime/cli/workload.py holds what run and
    sample share)."""
    found = []
    for path in [*(ROOT / "runtime").rglob("*.py"), *(ROOT / "scripts").rglob("*.py")]:
        text = path.read_text()
        for match in re.finditer(r"^\s*from (runtime[\w.]*|backends[\w.]*) import (\([^)]*\)|[^\n]*)", text, re.M):
            entries = match.group(2).strip("()").replace("\n", " ").split(",")
            imported = [e.split("#")[0].split(" as ")[0].strip() for e in entries]  # `name as alias`: the name
            for name in (n for n in imported if n.startswith("_") and not n.startswith("__")):
                key = (str(path.relative_to(ROOT)), name)
                if key not in PRIVATE_IMPORTS_ALLOWED:
                    found.append(f"{key[0]}: {name} from {match.group(1)}")
    assert not found, "\n".join(found)


def test_a_method_is_data_in_the_core():
    """MethodSpec reads what it knows of a method from its declared row (runtime.config.method_options
    METHOD_DECLS): no branch on a method's name in runtime/core/methods.py."""
    text = (ROOT / "runtime" / "core" / "methods.py").read_text()
    branches = [line.strip() for line in text.splitlines() if re.search(r"self\.method\s*(==|!=|in\b)", line)]
    assert not branches, branches


def test_policies_see_the_config_and_their_view_not_the_decoder():
    """The drafting policies read settings from `DecodeConfig` and buffers through `DraftView`:
    they import neither the decoder nor a mutable shared state object."""
    for name in ("drafting.py", "jacobi.py", "pjd.py", "policies.py"):
        text = (ROOT / "runtime" / "core" / name).read_text()
        assert "runtime.core.decoder" not in text and "DecodeState" not in text and "self.state" not in text, name


def test_config_buffers_view_and_proposals_are_built_whole_and_never_rebound():
    """One construction each, frozen: no field starts as None to be filled later, and a decoder's
    buffers keep their identities across images (graph capture replays into them)."""
    import dataclasses

    import pytest
    import torch

    from runtime.core import MethodSpec, SamplingParams
    from runtime.core.decoder import Decoder
    from tiny_models import tiny_pair

    target, drafter = tiny_pair()
    spec = MethodSpec("lantern++", sampling=SamplingParams(greedy=False, cfg=1.0), tree="chain3",
                      lantern_lambda=2.0)
    vocab = target.config.vocab_size
    neighbours = torch.stack([torch.roll(torch.arange(vocab), -i)[1:] for i in range(vocab)])
    dec = Decoder(target, drafter, spec, neighbours=neighbours, batch_size=2)
    for obj in (dec.config, dec.buffers, dec.policy.view, *dec.proposals.values()):
        assert dataclasses.is_dataclass(obj) and type(obj).__dataclass_params__.frozen  # type: ignore[attr-defined]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dec.buffers.tokens = torch.zeros(1)  # type: ignore[misc]
    unset = [f.name for f in dataclasses.fields(dec.buffers) if getattr(dec.buffers, f.name) is None]
    assert unset == ["node_hits"]  # allocated only with track_nodes
    proposal = dec.proposals[dec.policy.tree.max_depth]
    assert proposal.tokens.data_ptr() == dec.buffers.tokens.data_ptr()
    assert proposal.q is not None and proposal.q.data_ptr() == dec.buffers.q.data_ptr()
    before = {f.name: getattr(dec.buffers, f.name).data_ptr() for f in dataclasses.fields(dec.buffers)
              if getattr(dec.buffers, f.name) is not None}
    dec.generate_many([(torch.tensor([c]), None, c) for c in range(3)])
    after = {name: getattr(dec.buffers, name).data_ptr() for name in before}
    assert after == before


def test_policies_write_only_the_draft_tokens_and_q():
    """The view's other buffers are the loop's: no policy assigns into them, copies into them or
    names them as an op's `out=` (a regex over the policy modules)."""
    read_only = r"(count|out|p|hidden|block|accepted|block_ids|live_now)"
    writes = [rf"view\.{read_only}\[[^\]]*\]\s*=(?!=)", rf"view\.{read_only}(\[[^\]]*\])?\.\w+_\(",
              rf"out=\(?view\.{read_only}\b", rf"_into\(view\.{read_only}\b"]
    found = []
    for name in ("drafting.py", "jacobi.py", "pjd.py"):
        for i, line in enumerate((ROOT / "runtime" / "core" / name).read_text().splitlines(), 1):
            if any(re.search(w, line) for w in writes):
                found.append(f"{name}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
    assert re.search(r"view\.tokens\[[^\]]*\]\s*=", (ROOT / "runtime" / "core" / "jacobi.py").read_text())
