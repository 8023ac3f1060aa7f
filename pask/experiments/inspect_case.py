"""`pask inspect`: show one case's prompt labels and generated tokens with their structural tags."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pask.structure.tags import PromptLabel, Tag

LABEL_STYLE = {
    PromptLabel.PROTECTED_CONTENT: "white",
    PromptLabel.SCHEMA_SCAFFOLD: "grey50",
    PromptLabel.FUNCTION_NAME: "bold magenta",
    PromptLabel.PARAMETER_KEY: "bold cyan",
    PromptLabel.TYPE_CONSTRAINT: "yellow",
    PromptLabel.ENUM_CONSTRAINT: "bold green",
}
ROLE_STYLE = {
    "dispatch_key": "bold magenta",
    "required": "bold cyan",
    "optional": "cyan",
    "scaffold_separator": "grey50",
    "relation": "bold magenta",
    "projection": "bold cyan",
    "predicate": "bold green",
    "outside_schema": "grey50",
}


def render(
    prompt_tokens: list[str],
    labels: list[PromptLabel],
    out_tokens: list[str],
    tags: list[Tag],
    title: str,
) -> Console:
    """Print a labelled prompt and a tag table to a recording console (for --html)."""
    console = Console(record=True, width=140)
    console.rule(f"[bold]{title}")
    legend = Text("prompt labels: ")
    for label, style in LABEL_STYLE.items():
        legend.append(f"{label.value} ", style=style)
    console.print(legend)
    text = Text()
    for piece, label in zip(prompt_tokens, labels, strict=True):
        text.append(piece, style=LABEL_STYLE.get(label, "white"))
    console.print(text)
    console.rule("generated tokens")
    table = Table("#", "token", "class", "role", "state", "next")
    for i, (piece, tag) in enumerate(zip(out_tokens, tags, strict=True)):
        style = ROLE_STYLE.get(str(tag.role), "white")
        parts = (str(tag.cls), str(tag.role), str(tag.state), str(tag.next))
        table.add_row(str(i), Text(repr(piece), style=style), *parts)
    console.print(table)
    return console


def write_html(console: Console, path: Path) -> None:
    """Write what the console recorded as a self-contained HTML page."""
    path.write_text(console.export_html(inline_styles=True))
