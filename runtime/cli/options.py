"""Options shared by `runtime run` and `runtime bench` (model, device, method and sampling flags).

Method and sampling options default to None: unset flags fall back to the hardware profile,
then to the model's recommended settings (see runtime.generation.settings.resolve_spec).
"""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Any, Callable, Optional, Sequence

import typer

from runtime.config.method_options import METHOD_OPTIONS, METHODS, OPTIONS_BY_NAME, MethodFlags
from runtime.generation.source import ModelSource
from runtime.generation.device_setup import open_backend  # noqa: F401 - the commands' backend and profile, re-exported

Model = Annotated[Optional[str], typer.Option("--model", help="'demo' (default), a bundle directory from 'runtime train demo', a model folder (Chameleon, Janus, Emu3: its config.json's model_type decides) or a Hugging Face Hub id such as deepseek-community/Janus-Pro-1B (resolved in the HF cache; HF_HOME, HF_HUB_OFFLINE).", rich_help_panel='Model')]
ModelRevision = Annotated[Optional[str], typer.Option("--model-revision", help="Branch, tag or commit of a --model given by Hub id (default: main).", rich_help_panel='Model')]
GptModel = Annotated[Optional[str], typer.Option("--gpt-model", help="Official LlamaGen config: GPT-B, GPT-L, GPT-XL, GPT-XXL, GPT-3B.", rich_help_panel='Model')]
GptCkpt = Annotated[Optional[str], typer.Option("--gpt-ckpt", help="Official GPT checkpoint (.pt/.pth/.safetensors), an HF LlamaGen folder, or a Hub file OWNER/NAME:FILE (e.g. FoundationVision/LlamaGen:c2i_XL_384.pt).", rich_help_panel='Model')]
GptType = Annotated[str, typer.Option("--gpt-type", help="c2i or t2i (for --gpt-ckpt files).", rich_help_panel='Model')]
VqCkpt = Annotated[Optional[str], typer.Option("--vq-ckpt", help="Official VQ checkpoint, e.g. vq_ds16_c2i.pt, or a Hub file OWNER/NAME:FILE.", rich_help_panel='Model')]
ImageSize = Annotated[Optional[int], typer.Option("--image-size", help="Image size the GPT checkpoint was trained for (256, 384, 512); default: the size in the file name (c2i_XL_384.pt).", rich_help_panel='Model')]
DrafterDir = Annotated[Optional[str], typer.Option("--drafter", help="LANTERN drafter folder (config.json + weights), or its Hub id.", rich_help_panel='Model')]
Trust = Annotated[bool, typer.Option("--trust-checkpoint", help="Allow checkpoints that contain pickled Python objects (only for files you trust).", rich_help_panel='Model')]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or hpu.", rich_help_panel='Device')]
ProfileName = Annotated[Optional[str], typer.Option("--profile-name", help="Hardware profile name (cpu, rtx3090, h100, gaudi2) or a TOML file.", rich_help_panel='Device')]
Graph = Annotated[Optional[bool], typer.Option("--graph/--no-graph", envvar="LANTERN_GRAPH", show_envvar=True, help="Capture the fixed-shape steps as device graphs (default: the profile's; LANTERN_GRAPH=0 or 1 sets it for every command).", rich_help_panel='Device')]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32 (default: the profile's).", rich_help_panel='Device')]
Method = Annotated[Optional[str], typer.Option("--method", help=f"{', '.join(METHODS[:-1])} or {METHODS[-1]} (sjd and pjd need no drafter); run and serve also take auto (the profile's fastest lossless method at the batch occupancy, from runtime tune).", rich_help_panel='Method and sampling (every method)')]
Attention = Annotated[str, typer.Option("--attention", help="Attention kernel: auto (fastest available) or math (LlamaGen's reference kernel: bf16 tokens match the reference).", rich_help_panel='Method and sampling (every method)')]
BatchSize = Annotated[Optional[int], typer.Option("--batch-size", help="Images decoded together (default: the profile's, 1); every image's tokens are the same at any batch size.", rich_help_panel='Device')]
Classes = Annotated[Optional[str], typer.Option("--classes", help="Comma-separated class ids, cycled over the images (c2i).", rich_help_panel='Workload')]
Prompts = Annotated[Optional[str], typer.Option("--prompts", help="Text file, one prompt per line (t2i; needs --t5-path).", rich_help_panel='Workload')]
T5Path = Annotated[Optional[str], typer.Option("--t5-path", help="Local T5 encoder directory (flan-t5-xl for LlamaGen t2i).", rich_help_panel='Workload')]
PromptLength = Annotated[Optional[int], typer.Option("--prompt-length", help="Prompted models (Chameleon, Janus, Emu3): pad every prompt to this many tokens (it sets the captured steps' shapes; runtime serve: default 64).", rich_help_panel='Workload')]
NumImages = Annotated[Optional[int], typer.Option("--num-images", help="Images to generate (default: one per class or prompt).", rich_help_panel='Workload')]
Seed = Annotated[int, typer.Option("--seed", help="Run seed; image i uses a seed derived from (seed, i).", rich_help_panel='Workload')]


def method_parameters(only: Sequence[str] | None = None) -> list[inspect.Parameter]:
    """Typer parameters for the method options (`runtime.config.method_options.METHOD_OPTIONS`, or those
    named in `only`), each `--flag` with its help, panel and readers, default None (unset: the
    profile's, then the model's, then the code default)."""
    chosen = METHOD_OPTIONS if only is None else [OPTIONS_BY_NAME[name] for name in only]
    return [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                              annotation=Annotated[Optional[o.kind], typer.Option(  # type: ignore[name-defined]
                                  o.cli_flag, help=o.cli_help, rich_help_panel=o.panel)])
            for o in chosen]


def _inject(fn: Callable[..., Any], slot: str, generated: list[inspect.Parameter],
            build: Callable[[dict[str, Any]], Any]) -> Callable[..., Any]:
    """`fn` with its parameter `slot` replaced, on the command line, by the `generated` options;
    the function receives `slot=build({option: value})`."""
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())
    at = [p.name for p in params].index(slot)
    names = [p.name for p in generated]

    @functools.wraps(fn)
    def command(**kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in names if name in kwargs}
        return fn(**kwargs, **{slot: build(given)})

    # annotations resolved here (the command's module may postpone them as strings)
    hints = typing.get_type_hints(fn, include_extras=True)
    keyword = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation))
               for p in params]
    listed = keyword[:at] + generated + keyword[at + 1:]
    command.__signature__ = signature.replace(parameters=listed, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in listed}
    del command.__wrapped__  # typer reads the signature above, not fn's
    return command


def with_method_options(only: Sequence[str] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a command taking `flags: MethodFlags`: its command line gets the method
    options in place of `flags` (every option, or those in `only`), and the function receives
    them as one `MethodFlags`. The options are declared once, in `runtime.config.method_options`."""
    return lambda fn: _inject(fn, "flags", method_parameters(only), lambda given: MethodFlags(**given))


# The model options of every command that loads a model, in their command-line order.
MODEL_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("model", Model, None), ("model_revision", ModelRevision, None), ("gpt_model", GptModel, None), ("gpt_ckpt", GptCkpt, None), ("gpt_type", GptType, "c2i"),
    ("vq_ckpt", VqCkpt, None), ("image_size", ImageSize, None), ("drafter", DrafterDir, None),
    ("trust_checkpoint", Trust, False),
)


def with_model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a command taking `source: ModelSource`: its command line gets the model
    options (`MODEL_OPTIONS`) in place of `source`, and the function receives them as one
    `ModelSource`."""
    generated = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
                 for name, annotation, default in MODEL_OPTIONS]
    return _inject(fn, "source", generated, lambda given: ModelSource(**given))
