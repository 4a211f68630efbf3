"""Options shared by `runtime run` and `runtime bench` (model, device, method and sampling flags).

Method and sampling options default to None: unset flags fall back to the hardware profile,
then to the model's recommended settings (see runtime.pipeline.resolve_spec).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Annotated, Any, Optional

import typer

from runtime.errors import UserError
from runtime.method_flags import readers

Model = Annotated[Optional[str], typer.Option("--model", help="'demo' (default) or a bundle directory from 'runtime train demo'.", rich_help_panel='Model')]
GptModel = Annotated[Optional[str], typer.Option("--gpt-model", help="Official LlamaGen config: GPT-B, GPT-L, GPT-XL, GPT-XXL, GPT-3B.", rich_help_panel='Model')]
GptCkpt = Annotated[Optional[str], typer.Option("--gpt-ckpt", help="Official GPT checkpoint (.pt/.pth/.safetensors) or an HF LlamaGen folder.", rich_help_panel='Model')]
GptType = Annotated[str, typer.Option("--gpt-type", help="c2i or t2i (for --gpt-ckpt files).", rich_help_panel='Model')]
VqCkpt = Annotated[Optional[str], typer.Option("--vq-ckpt", help="Official VQ checkpoint, e.g. vq_ds16_c2i.pt.", rich_help_panel='Model')]
ImageSize = Annotated[Optional[int], typer.Option("--image-size", help="Image size the GPT checkpoint was trained for (256, 384, 512); default: the size in the file name (c2i_XL_384.pt).", rich_help_panel='Model')]
DrafterDir = Annotated[Optional[str], typer.Option("--drafter", help="LANTERN drafter folder (config.json + weights).", rich_help_panel='Model')]
Trust = Annotated[bool, typer.Option("--trust-checkpoint", help="Allow checkpoints that contain pickled Python objects (only for files you trust).", rich_help_panel='Model')]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or hpu.", rich_help_panel='Device')]
ProfileName = Annotated[Optional[str], typer.Option("--profile-name", help="Hardware profile name (cpu, rtx3090, h100, gaudi2) or a TOML file.", rich_help_panel='Device')]
Graph = Annotated[Optional[bool], typer.Option("--graph/--no-graph", help="Capture the fixed-shape steps as device graphs (default: the profile's).", rich_help_panel='Device')]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32 (default: the profile's).", rich_help_panel='Device')]
Method = Annotated[Optional[str], typer.Option("--method", help="ar, sd, eagle2, ddd, lantern, lantern++ or sjd (no drafter needed).", rich_help_panel='Method and sampling (every method)')]
Greedy = Annotated[Optional[bool], typer.Option("--greedy/--sample", help="Greedy decoding instead of sampling.", rich_help_panel='Method and sampling (every method)')]
Temperature = Annotated[Optional[float], typer.Option("--temperature", help="Sampling temperature.", rich_help_panel='Method and sampling (every method)')]
TopK = Annotated[Optional[int], typer.Option("--top-k", help="Target top-k filter (0 = off).", rich_help_panel='Method and sampling (every method)')]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Target nucleus filter (1 = off).", rich_help_panel='Method and sampling (every method)')]
Cfg = Annotated[Optional[float], typer.Option("--cfg", help="Classifier-free guidance scale (<= 1 = off).", rich_help_panel='Method and sampling (every method)')]
CfgInterval = Annotated[Optional[int], typer.Option("--cfg-interval", help="LlamaGen's cfg_interval: -1 = guide every token; N >= 0 = no guidance after decode step N (needs --cfg > 1).", rich_help_panel='Method and sampling (every method)')]
Attention = Annotated[str, typer.Option("--attention", help="Attention kernel: auto (fastest available) or math (LlamaGen's reference kernel: bf16 tokens match the reference).", rich_help_panel='Method and sampling (every method)')]
Tree = Annotated[Optional[str], typer.Option("--tree", help="Static tree: a preset (naive_extend_57, mc_sim_7b_63, chain, small_12), chainN, or a TOML file. Read by: " + readers("tree") + ".", rich_help_panel='Drafting (read by the methods named)')]
LanternK = Annotated[Optional[int], typer.Option("--lantern-k", help="Nearest codebook neighbours considered for the proximity set. Read by: " + readers("lantern_k") + ".", rich_help_panel='Relaxed acceptance (read by the methods named)')]
LanternDelta = Annotated[Optional[float], typer.Option("--lantern-delta", help="LANTERN total-variation budget (0 = exact). Read by: " + readers("lantern_delta") + ".", rich_help_panel='Relaxed acceptance (read by the methods named)')]
LanternLambda = Annotated[Optional[float], typer.Option("--lantern-lambda", help="LANTERN++ multiplicative bound (1 = exact). Read by: " + readers("lantern_lambda") + ".", rich_help_panel='Relaxed acceptance (read by the methods named)')]
RelaxRule = Annotated[Optional[str], typer.Option("--relax-rule", help="paper (default: the reference LANTERN code's acceptance) or bounded (each step's output within the stated TVD bound). Read by: " + readers("relax_rule") + " (sjd: with a relaxation).", rich_help_panel='Relaxed acceptance (read by the methods named)')]
Depth = Annotated[Optional[int], typer.Option("--depth", help="Chain length (sd) or EAGLE-2 tree depth. Read by: " + readers("depth") + ".", rich_help_panel='Drafting (read by the methods named)')]
TopKDraft = Annotated[Optional[int], typer.Option("--top-k-draft", help="EAGLE-2 children per expanded node. Read by: " + readers("top_k_draft") + ".", rich_help_panel='Drafting (read by the methods named)')]
TotalTokens = Annotated[Optional[int], typer.Option("--total-tokens", help="EAGLE-2 verified tokens per step (root included). Read by: " + readers("total_tokens") + ".", rich_help_panel='Drafting (read by the methods named)')]
BatchSize = Annotated[Optional[int], typer.Option("--batch-size", help="Images decoded together (default: the profile's, 1); every image's tokens are the same at any batch size.", rich_help_panel='Device')]
Window = Annotated[Optional[int], typer.Option("--window", help="sjd: draft window length L (default 16).", rich_help_panel='sjd only')]
Init = Annotated[Optional[str], typer.Option("--init", help="sjd: prior of fresh window positions: uniform, repeat-h (token to the left) or repeat-v (token above; default).", rich_help_panel='sjd only')]
Coupling = Annotated[Optional[str], typer.Option("--coupling", help="sjd: how stale drafts are redrafted: none (default), maximal or gumbel.", rich_help_panel='sjd only')]
Proactive = Annotated[Optional[str], typer.Option("--proactive", help="sjd: K,D = a K-ary tree of depth D drafted at the start of the window (SJD-PAC style).", rich_help_panel='sjd only')]
Accept = Annotated[Optional[str], typer.Option("--accept", help="sjd: exact (default) or grouped (GSD-style, lossy; its TVD bound is reported).", rich_help_panel='sjd only')]
GroupWindow = Annotated[Optional[int], typer.Option("--group-window", help="--accept grouped: rank window on each side of the draft (default 7).", rich_help_panel='sjd only')]
GroupGap = Annotated[Optional[float], typer.Option("--group-gap", help="--accept grouped: largest probability gap to the draft (default 0.15).", rich_help_panel='sjd only')]
GroupDist = Annotated[Optional[float], typer.Option("--group-dist", help="--accept grouped: largest squared distance of normalised embedding rows (default 0.5).", rich_help_panel='sjd only')]
DddThreshold = Annotated[Optional[float], typer.Option("--ddd-threshold", help="ddd: stop drafting when log(sum of the beam's path probabilities) falls below this (default -0.3).", rich_help_panel='ddd only')]
DddCheckEvery = Annotated[Optional[int], typer.Option("--ddd-check-every", help="ddd: expansions between two checks of the heuristic (default 2; each check is one host read).", rich_help_panel='ddd only')]
DddMinDepth = Annotated[Optional[int], typer.Option("--ddd-min-depth", help="ddd: expansions before the first check (default 4).", rich_help_panel='ddd only')]
DddMaxDepth = Annotated[Optional[int], typer.Option("--ddd-max-depth", help="ddd: most expansions (default 10).", rich_help_panel='ddd only')]
DynamicDepth = Annotated[Optional[float], typer.Option("--dynamic-depth", help="sd/lantern++: cut the static tree at the first depth whose best drafted path probability is below this threshold (e.g. 0.2); off by default. Read by: " + readers("dynamic_depth") + ".", rich_help_panel='Drafting (read by the methods named)')]
Classes = Annotated[Optional[str], typer.Option("--classes", help="Comma-separated class ids, cycled over the images (c2i).", rich_help_panel='Workload')]
Prompts = Annotated[Optional[str], typer.Option("--prompts", help="Text file, one prompt per line (t2i; needs --t5-path).", rich_help_panel='Workload')]
T5Path = Annotated[Optional[str], typer.Option("--t5-path", help="Local T5 encoder directory (flan-t5-xl for LlamaGen t2i).", rich_help_panel='Workload')]
NumImages = Annotated[Optional[int], typer.Option("--num-images", help="Images to generate (default: one per class or prompt).", rich_help_panel='Workload')]
Seed = Annotated[int, typer.Option("--seed", help="Run seed; image i uses a seed derived from (seed, i).", rich_help_panel='Workload')]


@dataclass
class MethodFlags:
    """The method/sampling flags as given (None = not given)."""

    greedy: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    cfg: float | None = None
    cfg_interval: int | None = None
    tree: str | None = None
    lantern_k: int | None = None
    lantern_delta: float | None = None
    lantern_lambda: float | None = None
    relax_rule: str | None = None
    depth: int | None = None
    top_k_draft: int | None = None
    total_tokens: int | None = None
    window: int | None = None
    init: str | None = None
    coupling: str | None = None
    proactive: str | None = None
    accept: str | None = None
    group_window: int | None = None
    group_gap: float | None = None
    group_dist: float | None = None
    ddd_threshold: float | None = None
    ddd_check_every: int | None = None
    ddd_min_depth: int | None = None
    ddd_max_depth: int | None = None
    dynamic_depth: float | None = None

    @classmethod
    def pick(cls, params: dict[str, Any]) -> "MethodFlags":
        """The method flags among a command's parameters (its `locals()`)."""
        return cls(**{f.name: params[f.name] for f in fields(cls)})

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def open_backend(device: str, profile_name: str | None, graph: bool | None, dtype: str | None,
                 index: int | None = None):
    """(backend, profile): the backend for --device and the profile for it (or --profile-name)."""
    from backends import get_backend
    from runtime.profiles import default_profile_for, load_profile

    given = load_profile(profile_name) if profile_name else None
    # Gaudi's lazy/eager mode is fixed when habana_frameworks is first imported, which probing
    # does: choose it from the profile (gaudi2 is the only HPU profile) before probing.
    lazy = (given or load_profile("gaudi2")).device.hpu_lazy_mode if device in ("hpu", "auto") else None
    probe = get_backend(device, graph_mode=False, index=index, hpu_lazy_mode=lazy)
    profile = given or default_profile_for(probe.name, str(probe.info().get("name", "")))
    graph_mode = profile.device.graph if graph is None else graph
    backend = get_backend(probe.name, dtype=dtype or profile.device.dtype, graph_mode=graph_mode,
                          index=index, hpu_lazy_mode=profile.device.hpu_lazy_mode)
    logging.getLogger("runtime.cli").info("device %s (%s), profile %s (%s), graph mode %s, dtype %s", backend.name,
                                          probe.info().get("name", "?"), profile.name, profile.source,
                                          "on" if graph_mode else "off", dtype or profile.device.dtype)
    return backend, profile


IN_MEMORY_IMAGES = 100_000  # run / bench keep every image in memory; beyond this, runtime sample
SAMPLE_IMAGES = 10_000_000  # runtime sample keeps one condition per image


def check_num_images(flag: int | None, limit: int = IN_MEMORY_IMAGES) -> None:
    """Refuse --num-images below 1 or above what the command can hold (`limit`)."""
    if flag is None:
        return
    if flag < 1:
        raise UserError(f"--num-images must be >= 1, got {flag}")
    if flag > limit:
        hint = ("use runtime sample (chunked, resumable, flat memory)" if limit == IN_MEMORY_IMAGES
                else "split the work into several sampling runs")
        raise UserError(f"--num-images {flag:,} is more than this command holds ({limit:,}); {hint}")


def batch_size(flag: int | None, profile: Any) -> int:
    """--batch-size if given, else the profile's `[device] batch_size`; refuses values below 1."""
    if flag is not None and flag < 1:
        raise UserError(f"--batch-size must be >= 1, got {flag}")
    return flag if flag is not None else profile.device.batch_size
