"""Eager ops per phase of every method on the demo (greedy and sampling, B 1 and 8) stay what
`tests/golden/phase_ops.json` recorded: a restructuring of the loop must not add or drop a
device op. Counts depend on torch's decompositions, so the check runs on the torch version the
file records (CI's); regenerate with `python tests/test_golden_ops.py` after a deliberate change."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "golden" / "phase_ops.json"
CASES = {"ar": {}, "sd": dict(tree="chain4"), "eagle2": {}, "ddd": {}, "lantern": dict(lantern_delta=0.1),
         "lantern++": dict(tree="naive_extend_57", lantern_lambda=2.0),
         "lantern++ dyn": dict(tree="naive_extend_57", lantern_lambda=2.0, dynamic_depth=0.1),
         "sjd": {}, "pjd": {}}
KEYS = [f"{name}/{mode}/b{b}" for name in CASES for mode in ("greedy", "sampling") for b in (1, 8)]


def _ops(key: str, bundle) -> dict[str, float]:
    from runtime.core import Decoder, MethodSpec, SamplingParams, neighbours_for
    from runtime.core.opcount import phase_ops

    name, mode, b = key.split("/")
    batch = int(b[1:])
    spec = MethodSpec(name.split()[0], SamplingParams(greedy=mode == "greedy", cfg=3.0), lantern_k=32,
                      **CASES[name])
    nb = neighbours_for(bundle.vq, spec, bundle.gpt.config.vocab_size)
    dec = Decoder(bundle.gpt, bundle.drafter if spec.needs_drafter else None, spec, neighbours=nb, batch_size=batch)
    with torch.no_grad():
        return phase_ops(dec, torch.arange(batch) % 10, seed=0, iterations=2)


@pytest.fixture(scope="module")
def bundle():
    from runtime.demo.bundle import load_demo_bundle

    return load_demo_bundle(device=torch.device("cpu"), dtype=torch.float32)


def test_the_golden_file_covers_every_case():
    assert sorted(json.loads(GOLDEN.read_text())["ops"]) == sorted(KEYS)


@pytest.mark.parametrize("key", KEYS)
def test_ops_per_phase_are_unchanged(bundle, key):
    golden = json.loads(GOLDEN.read_text())
    if golden["torch"] != torch.__version__:
        pytest.skip(f"op counts recorded with torch {golden['torch']}, this is {torch.__version__}")
    assert _ops(key, bundle) == golden["ops"][key]


if __name__ == "__main__":  # regenerate after a deliberate change in the ops
    from runtime.demo.bundle import load_demo_bundle

    demo = load_demo_bundle(device=torch.device("cpu"), dtype=torch.float32)
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "ops": {k: _ops(k, demo) for k in KEYS}},
                                 indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
