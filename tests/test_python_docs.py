"""Every Python block of docs/python.md runs, in order, in a fresh folder: on the demo, the tiny
Janus-Pro of `tests/hf_tiny.py` in a Hub cache (HF_HUB_OFFLINE=1), and, for the LlamaGen example,
tiny files under the page's names (GPT-tiny at 64 px stands for GPT-XL at 384: the test writes
them and substitutes the config name and size)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python.md"
# the page's checkpoint stands for a tiny one: what the snippet names -> what the test wrote
STAND_INS = {'gpt_model="GPT-XL"': 'gpt_model="GPT-tiny"', "image_size=384": "image_size=64",
             '"c2i_XL_384.pt"': '"c2i_tiny.pt"',
             "classes=[207, 360]": "classes=[207, 360], num_images=2"}


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_examples_the_issue_names() -> None:
    text = "\n".join(blocks())
    for needle in ("ImageGenerator()", "Janus-Pro-1B", "gpt_ckpt=", "drafter=", ".stream(", "batch_size=",
                   'method="ar"', 'device="cpu"'):
        assert needle in text, needle


@pytest.mark.slow
def test_every_python_block_runs(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("transformers")
    import hf_tiny
    from runtime.models.configs import DrafterConfig
    from runtime.models.drafter import Drafter
    from runtime.models.loading import save_drafter_folder
    from tiny_models import save_tiny_official

    home = tmp_path / "hf_home"
    hf_tiny.write_hub_cache(home)
    janus_id = "deepseek-community/Janus-Pro-1B"
    if hf_tiny.JANUS_ID != janus_id:  # the cache holds the tiny model under its own id
        STAND_INS[f'"{janus_id}"'] = f'"{hf_tiny.JANUS_ID}"'
    hf_tiny.use_hub_cache(monkeypatch, home)  # HF_HUB_OFFLINE restored after, though the page's block sets it too
    monkeypatch.setenv("LANTERN_GRAPH", "0")
    gpt = save_tiny_official(tmp_path, "c2i_tiny.pt", "vq_ds16_c2i.pt")
    save_drafter_folder(tmp_path / "drafter-XL", DrafterConfig.for_target(gpt.config),
                        Drafter(DrafterConfig.for_target(gpt.config)))
    monkeypatch.chdir(tmp_path)
    for i, code in enumerate(blocks()):
        for old, new in STAND_INS.items():
            code = code.replace(old, new)
        exec(compile(code, f"docs/python.md block {i}", "exec"), {"__name__": f"docs_block_{i}"})
        printed = capsys.readouterr().out
        assert "False" not in printed  # the page's equalities hold
    assert (tmp_path / "class0.png").is_file() and len(list(tmp_path.glob("stream_*.png"))) == 4
