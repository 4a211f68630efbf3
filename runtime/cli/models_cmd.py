"""`runtime models`: the model zoo as a table (name, kind, parameters, token grid, checkpoints)."""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from runtime.cli.app import app

# what each method needs of a model, whatever its family
METHOD_NEEDS = ("ar, sjd, pjd: no drafter; sd, eagle2, ddd, lantern, lantern++: a drafter for the target "
                "(--drafter DIR; `runtime train drafter --model ID --prompts FILE` makes one).")


def zoo_table() -> Table:
    """The zoo, each model's checkpoints under its name (fits 80 columns; long names fold)."""
    from runtime.models.zoo import zoo_rows

    table = Table(title="Model zoo", title_justify="left")
    table.add_column("model / checkpoints", overflow="fold", ratio=1)
    table.add_column("kind", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("tokens", no_wrap=True)
    for row in zoo_rows():
        files = "\n".join(f"  [dim]{line}[/]" for line in row["checkpoints"].split("\n"))
        table.add_row(f"[bold]{row['name']}[/]\n{files}", row["kind"], row["params"], row["token_grid"])
    table.caption = ("run an official checkpoint: runtime run --gpt-model GPT-B --gpt-ckpt c2i_B_256.pt "
                     "--vq-ckpt vq_ds16_c2i.pt --image-size 256; a model by Hub id: runtime run --model "
                     "deepseek-community/Janus-Pro-1B --prompts FILE (after `hf download` of the id). "
                     f"{METHOD_NEEDS}")
    return table


def zoo_json() -> list[dict[str, object]]:
    """The zoo as JSON rows: name, kind, parameters (an exact count), token_grids and checkpoints (lists)."""
    from runtime.models.zoo import MODEL_ZOO

    return [{"name": e.name, "kind": e.kind, "parameters": e.parameter_count(),
             "token_grids": e.token_grid.split("\n"), "checkpoints": list(e.checkpoints),
             "methods": _needs(e.kind)} for e in MODEL_ZOO]


def _needs(kind: str) -> dict[str, str] | None:
    """What each method needs to run a target of this kind (None for a VQ or a drafter)."""
    if kind in ("vq", "drafter", "chameleon-drafter"):
        return None
    from runtime.config.method_options import METHOD_TABLE

    return {m: "a drafter" if d.needs_drafter else "nothing" for m, d in METHOD_TABLE.items()}


@app.command("models")
def models_command(
    as_json: bool = typer.Option(False, "--json", help="Print the models as a JSON list instead of a table."),
) -> None:
    """List the models the runtime can load, with parameter counts and checkpoint files."""
    if as_json:
        typer.echo(json.dumps(zoo_json(), indent=2))
    else:
        Console().print(zoo_table())
