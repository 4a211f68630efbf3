"""The model zoo and `runtime models`: parameter counts of the released models, computed on the
meta device, and the table the command prints."""

from __future__ import annotations

import pytest

from runtime.models.zoo import MODEL_ZOO, format_params, zoo_rows

# LlamaGen README / reference: B 111M, L 343M, XL 775M, XXL 1.4B, 3B 3.1B, VQ-16 72M.
EXPECTED = {
    ("GPT-B", "gpt-c2i"): "110.9M",
    ("GPT-L", "gpt-c2i"): "342.9M",
    ("GPT-XL", "gpt-c2i"): "774.7M",
    ("GPT-XXL", "gpt-c2i"): "1411.0M (1.4B)",
    ("GPT-3B", "gpt-c2i"): "3096.7M (3.1B)",
    ("GPT-XL", "gpt-t2i"): "777.7M",
    ("VQ-16", "vq"): "71.9M",
}


@pytest.mark.parametrize(("name", "kind"), list(EXPECTED))
def test_parameter_counts_of_released_models(name, kind):
    entry = next(e for e in MODEL_ZOO if (e.name, e.kind) == (name, kind))
    assert format_params(entry.parameter_count()) == EXPECTED[name, kind]


def test_lantern_drafter_parameter_count():
    """embed 16384x1280 + fc 2560x1280 (+bias) + q,k,v,o 1280^2 + SwiGLU 3x1280x3584 + norm."""
    entry = next(e for e in MODEL_ZOO if e.checkpoints == ("jadohu/llamagen_drafter",))
    expected = 16384 * 1280 + (2560 * 1280 + 1280) + 4 * 1280**2 + 3 * 1280 * 3584 + 1280
    assert entry.kind == "drafter" and entry.parameter_count() == expected


@pytest.mark.parametrize(("n", "text"), [
    (110_888_448, "110.9M"), (999_949_999, "999.9M"), (1_410_972_672, "1411.0M (1.4B)"),
    (3_096_659_200, "3096.7M (3.1B)"), (71_883_403, "71.9M"),
])
def test_format_params(n, text):
    assert format_params(n) == text


def test_every_kind_is_listed_with_checkpoint_files():
    rows = zoo_rows()
    assert {r["kind"] for r in rows} == {"demo", "gpt-c2i", "gpt-t2i", "vq", "drafter", "chameleon",
                                         "chameleon-drafter", "janus", "emu3"}
    assert all(r["checkpoints"] and r["token_grid"] for r in rows)
    gpt_b = next(r for r in rows if r["name"] == "GPT-B")
    assert gpt_b["checkpoints"].split("\n") == ["c2i_B_256.pt", "c2i_B_384.pt"]
    assert gpt_b["token_grid"].split("\n") == ["16x16", "24x24"]


def test_runtime_models_prints_the_zoo(run_cli):
    result = run_cli("models")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    for (name, kind), params in EXPECTED.items():
        assert any(name in line and kind in line and params in line for line in lines), (name, kind)
    for ckpt in ("c2i_B_256.pt", "c2i_3B_384.pt", "vq_ds16_c2i.pt", "jadohu/llamagen_drafter"):
        assert ckpt in result.stdout


def test_runtime_models_lists_the_demo_and_the_chameleon_family_within_80_columns():
    from rich.console import Console

    from runtime.cli.models_cmd import zoo_table

    console = Console(width=80, record=True)
    console.print(zoo_table())
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for name in ("demo", "Anole-7B", "Lumina-mGPT-7B-768", "LANTERN-Anole", "jadohu/anole_drafter", "3.5M",
                 "Janus-Pro-1B", "Janus-Pro-7B", "BAAI/Emu3-Gen-hf", "lantern++: a drafter"):
        assert name in text, name


def test_janus_pro_1b_counts_its_generation_path():
    """Language model (embed 102400x2048, 24 Llama layers, norm) + generation embedding 16384x8,
    aligner 8->2048->2048, head 2048->2048->16384 (with biases); the understanding path is not counted."""
    entry = next(e for e in MODEL_ZOO if e.name == "Janus-Pro-1B")
    d, f = 2048, 5632
    layer = 4 * d * d + 3 * d * f + 2 * d
    expected = (102400 * d + 24 * layer + d + 16384 * 8 + (8 * d + d) + (d * d + d) + (d * d + d)
                + (d * 16384 + 16384))
    assert entry.kind == "janus" and entry.parameter_count() == expected


def test_runtime_models_json_says_what_each_method_needs(run_cli):
    import json

    rows = {r["name"]: r for r in json.loads(run_cli("models", "--json").stdout)}
    assert rows["Emu3-Gen"]["methods"]["sjd"] == "nothing" and rows["Emu3-Gen"]["methods"]["lantern++"] == "a drafter"
    assert rows["VQ-16"]["methods"] is None
