"""`runtime models`: the model zoo as a table (name, kind, parameters, token grid, checkpoints)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from runtime.cli.app import app


def zoo_table() -> Table:
    from runtime.models.zoo import zoo_rows

    table = Table(title="Model zoo", title_justify="left")
    table.add_column("name", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("params", justify="right", no_wrap=True)
    table.add_column("tokens", no_wrap=True)
    table.add_column("checkpoints", overflow="fold")
    for row in zoo_rows():
        table.add_row(row["name"], row["kind"], row["params"], row["token_grid"], row["checkpoints"])
    table.caption = ("run an official checkpoint: runtime run --gpt-model GPT-B --gpt-ckpt c2i_B_256.pt "
                     "--vq-ckpt vq_ds16_c2i.pt --image-size 256")
    return table


@app.command("models")
def models_command() -> None:
    """List the models the runtime can load, with parameter counts and checkpoint files."""
    Console().print(zoo_table())
