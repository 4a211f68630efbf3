"""Import the released Parallel Jacobi Decoding code (boyaliao/PJD @ e7b93ad, a checkout outside
this repository: $PJD_REFERENCE, default $PJDHARNESS_WORK/PJD) on a CPU-only machine without
editing any of its files, and the tiny vocabulary both make_model.py and released_run.py use.

Workarounds applied here (none touches the decoding logic):
  1. sys.path gets the checkout's root (`scheduler.*`, as test_lumina_mgpt.py imports it) and its
     `lumina_mgpt/` (whose modules import `data.*` and `model.*` as top-level packages).
  2. `data.item_processor` (FlexARItemProcessor: downloads the Lumina-mGPT text tokenizer and loads
     Meta's VQ-GAN from ./ckpts/chameleon/tokenizer/) is replaced by `StubItemProcessor`, which
     builds the same prompt layout from token ids directly ([<s>] + the question's tokens +
     [<reserved08706>], as Lumina-mGPT's Conversation + item processor do; the question's words
     are looked up in the tiny vocabulary's word-level tokenizer.json), answers token2id from the
     vocabulary map, and "decodes" an image by returning its token ids (no VQ decoder).
  3. The scheduler modules build constants with device="cuda" (`_init_new_params`' eol/eoi/end
     tokens, MultiModalLogitsProcessor_JACOBI's masks) and time `_sample` with torch.cuda.Event /
     torch.cuda.synchronize. Their module-global `torch` is replaced by `CpuTorch`, a proxy that
     forwards everything to torch but maps device "cuda" to "cpu" in torch.tensor / torch.arange
     and gives a wall-clock `cuda.Event` and a no-op `cuda.synchronize`. No other module is
     touched.
"""
from __future__ import annotations

import json
import os
import sys
import time
import types
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
WORK = os.environ.get("PJDHARNESS_WORK", os.path.join(os.getcwd(), "pjdharness-work"))
PJD = os.environ.get("PJD_REFERENCE", os.path.join(WORK, "PJD"))
PJD_COMMIT = "e7b93ad3c258b94af9786c22053ad7cc2df566f3"

# -- the tiny vocabulary: Chameleon / Lumina-mGPT's ids for everything the released code hardcodes --
BOS, PAD, EOS, UNK = 0, 1, 2, 3
N_CODES = 8192                      # image tokens 4..8195 (hardcoded: range(4, 8195 + 1) in the processors)
IMAGE_END = 8196                    # <eoss>          (hardcoded 8196 in _init_new_params)
IMAGE_START = 8197                  # <racm3:break>   (hardcoded 8197 in _sample)
END_OF_TURN = 8710                  # <reserved08706> (hardcoded 8710: eos, end token)
IMAGE_PLACEHOLDER = 8711            # <image>
ROW_END = 8803                      # <reserved08799> (hardcoded 8803 in _init_new_params)
SIZE_BASE = 8804                    # <reserved{8800+g}> = 8804 + g (hardcoded "- 8804" in the processors)
MAX_GRID = 32                       # size tokens for g = 1..32 (32 .. 1024 px)
WORDS = ["Generate", "an", "image", "of", "according", "to", "the", "following", "prompt", ":",
         "a", "red", "cat", "blue", "dog", "on", "grass", "lighthouse", "at", "night", "sea",
         "painting", "with", "by"] + [f"{s}x{s}" for s in (64, 128, 256, 384, 512, 768, 1024)]
WORD_BASE = 8840
VOCAB_SIZE = 8880


def code_name(i: int) -> str:
    """Chameleon's name of VQ code i: IMGIMG + the digits as letters A-J + Z."""
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(i)) + "Z"


def vocabulary_map() -> dict[str, int]:
    vocab = {"<s>": BOS, "<pad>": PAD, "</s>": EOS, "<unk>": UNK}
    vocab.update({code_name(i): 4 + i for i in range(N_CODES)})
    vocab.update({"<eoss>": IMAGE_END, "<racm3:break>": IMAGE_START, "<reserved08706>": END_OF_TURN,
                  "<image>": IMAGE_PLACEHOLDER, "<reserved08799>": ROW_END})
    vocab.update({f"<reserved{8800 + g:05d}>": SIZE_BASE + g for g in range(1, MAX_GRID + 1)})
    vocab.update({w: WORD_BASE + i for i, w in enumerate(WORDS)})
    assert len(set(vocab.values())) == len(vocab) and max(vocab.values()) < VOCAB_SIZE
    return vocab


def lumina_question(prompt: str, size: int) -> str:
    """test_lumina_mgpt.py's question: its template sentence + the prompt."""
    return f"Generate an image of {size}x{size} according to the following prompt:\n" + prompt


def size_token(size: int) -> int:
    return SIZE_BASE + size // 32


# -- workaround 3: the scheduler modules' `torch` -------------------------------------------------
class _CpuEvent:
    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.t = None

    def record(self, *_: Any) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:  # milliseconds, as torch.cuda.Event
        return (end.t - self.t) * 1000.0


def _cpu(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and str(dev).startswith("cuda"):
        kwargs = {**kwargs, "device": "cpu"}
    return kwargs


class CpuTorch(types.ModuleType):
    """`torch` for the scheduler modules: device "cuda" -> "cpu" in tensor/arange, CPU cuda.Event."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = types.SimpleNamespace(Event=_CpuEvent, synchronize=lambda *a, **k: None,
                                          manual_seed_all=torch.cuda.manual_seed_all)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(*args, **_cpu(kwargs))

    @staticmethod
    def arange(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.arange(*args, **_cpu(kwargs))


# -- workaround 2: the item processor --------------------------------------------------------------
TOKENIZER_JSON: str | None = None  # the tiny model folder's word-level tokenizer.json (set by the caller)

class _StubTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab
        self.names = {v: k for k, v in vocab.items()}

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.names.get(int(i), f"<{int(i)}>") for i in ids)


class StubItemProcessor:
    """Stands in for data.item_processor.FlexARItemProcessor (same constructor and the members the
    solver and the scheduler use)."""

    image_start_token = "<racm3:break>"
    image_end_token = "<eoss>"
    full_sub_sep_token = "<reserved08796>"
    sub_sub_sep_token = "<reserved08797>"
    sub_skip_token = "<reserved08798>"
    new_line_token = "<reserved08799>"

    def __init__(self, tokenizer=None, conv_template=None, target_size=512, with_decoder=False, device="cpu"):
        vocab = vocabulary_map()
        self.tokenizer = types.SimpleNamespace(tokenizer=_StubTokenizer(vocab), decode=_StubTokenizer(vocab).decode)
        self.vocab = vocab
        self.target_size = target_size
        self.device = device
        if TOKENIZER_JSON is None or not os.path.isfile(TOKENIZER_JSON):
            raise FileNotFoundError(f"{TOKENIZER_JSON}: set pjdenv.TOKENIZER_JSON to the model folder's tokenizer.json")
        from tokenizers import Tokenizer

        self.word_tokenizer = Tokenizer.from_file(TOKENIZER_JSON)

    def token2id(self, token: str) -> int:
        if token == "<|image|>":  # the placeholder decode_ids puts in the text for each image
            return IMAGE_PLACEHOLDER
        return self.vocab[token]

    def process_item(self, item, training_mode=False, out_flatten=True) -> list[int]:
        """Lumina-mGPT's text-only prompt: [<s>] + tokens(question + "<reserved08706>")."""
        (turn,) = [c["value"] for c in item["conversations"] if c["from"] == "human"]
        ids = self.word_tokenizer.encode(turn, add_special_tokens=False).ids
        return [BOS, *ids, END_OF_TURN]

    def decode_image(self, tokens: list[int]) -> list[int]:
        return list(tokens)


def install() -> types.ModuleType:
    """Make the checkout importable with the workarounds; returns the scheduler module."""
    if not os.path.isdir(os.path.join(PJD, "scheduler")):
        raise SystemExit(f"no PJD checkout at {PJD} (set PJD_REFERENCE or PJDHARNESS_WORK)")
    for path in (os.path.join(PJD, "lumina_mgpt"), PJD):
        if path not in sys.path:
            sys.path.insert(0, path)
    if "data.item_processor" not in sys.modules or not hasattr(sys.modules["data.item_processor"], "_pjdharness"):
        import data  # noqa: F401  (lumina_mgpt/data, a package)

        stub = types.ModuleType("data.item_processor")
        stub.FlexARItemProcessor = StubItemProcessor
        stub._pjdharness = True
        sys.modules["data.item_processor"] = stub
    import scheduler.jacobi_iteration_lumina_mgpt as jac
    import scheduler.logit_processor_3dim as lp3

    proxy = CpuTorch()
    jac.torch = proxy
    lp3.torch = proxy
    return jac


def text_tokenizer_json(vocab: dict[str, int]) -> str:
    """Meta's text_tokenizer.json shape as far as the released code reads it (["model"]["vocab"])."""
    return json.dumps({"model": {"vocab": vocab}})
