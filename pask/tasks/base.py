"""The task interface: what evaluation, sweeps and calibration need to know about a task.

A :class:`Task` names its splits and options, loads a split's cases, builds each case's prompt and
output grammar (:class:`TaskRequest`), checks a finished output (:class:`Output`) and summarises
the per-case rows. Everything else -- decoding, batching, resuming, writing ``cases.jsonl`` /
``summary.json`` / ``summary.md`` -- is the task-independent runner
(:func:`pask.evaluation.runner.run_task`). Tasks sit below the decode runtime: a task returns
plain data, the runner compiles the grammar and builds the engine request.

A case is any object with a unique string ``id``. Its row in ``cases.jsonl`` is, in this order:
:meth:`Task.case_fields`, ``prompt_len``, ``output``, :meth:`Task.check`, then ``stop_reason``,
``n_generated``, ``prefill_ms``, ``tpot_ms``, ``budget``, ``tags``, ``prompt_labels``.

Register a task with :func:`pask.tasks.register_task`; ``pask eval NAME``, sweeps (``tasks = ["NAME"]``)
and ``pask calibrate --task NAME`` then run it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pask.errors import PaskError

COMMON_SPLITS = ("calibration", "dev", "test")


@dataclass
class TaskRequest:
    """What a task asks the decoder for one case.

    ``grammar``: a lark grammar (llguidance syntax) the output must follow, ``None`` for free text;
    the runner compiles it with the model's tokenizer (a grammar that does not compile makes the
    case a ``schema_error`` row). ``parse``: turns the final text into the parsed output the checker
    receives (``Output.parsed``; an exception's message becomes ``Output.parse_error``).
    ``tagger`` / ``prompt_labels``: the structural tagger of generated tokens and the label of each
    prompt token, built only when asked for (``tagging``: policies that need them, ``--save-tags``).
    ``error``: why the case cannot run at all (scored wrong, never decoded). ``constrain``: builds the
    grammar's constraint from (llguidance tokenizer, grammar, EOS ids); None: a plain
    :class:`~pask.structure.constraint.Constraint` (text-to-SQL's scope check plugs in here).
    """

    prompt_ids: list[int]
    grammar: str | None = None
    parse: Callable[[str], Any] | None = None
    tagger: Any = None
    prompt_labels: list | None = None
    error: str | None = None
    constrain: Callable[..., Any] | None = None


@dataclass(frozen=True)
class Output:
    """A case's output as its checker sees it.

    ``stop_reason``: ``grammar`` | ``eos`` | ``length`` (ran into ``max_new_tokens``), or
    ``schema_error`` with ``error`` set for a case that could not run (the checker scores it wrong
    and reports ``error``).
    """

    text: str
    stop_reason: str
    parsed: Any = None
    parse_error: str | None = None
    error: str | None = None


class Task(abc.ABC):
    """One evaluation task (see the module docstring). Subclass, set the class attributes, implement
    the abstract methods and register an instance (:func:`pask.tasks.register_task`).

    Class attributes (``name`` and ``default_max_new_tokens`` required)
    ------------------------------------------------------------------
    name : str
        Registry key, ``pask eval NAME``, sweep configs and result paths.
    splits : tuple of str
        Split names :meth:`cases` accepts.
    options : dict
        The task's own options, name -> default (e.g. BFCL ``categories``, SQL ``data_dir``); every
        one of them changes results. A list default takes a list of the same element type (``--categories a,b``
        on the command line); options named in ``path_options`` are file paths (resolved against a
        sweep config's directory).
    default_max_new_tokens : int
        The generation allowance of an evaluation that does not set one.
    score_key : str
        The summary's overall score (``summary["overall"][score_key]``, in %).
    """

    name: ClassVar[str]
    splits: ClassVar[tuple[str, ...]] = COMMON_SPLITS
    options: ClassVar[Mapping[str, Any]] = {}
    path_options: ClassVar[tuple[str, ...]] = ()
    default_max_new_tokens: ClassVar[int]
    score_key: ClassVar[str] = "accuracy"

    # -- cases and requests -------------------------------------------------------------------------
    @abc.abstractmethod
    def cases(self, split: str, limit: int | None = None, **options: Any) -> list:
        """The cases of ``split`` (at most ``limit``, however the task counts); PaskError for bad input."""

    @abc.abstractmethod
    def request(self, case: Any, tokenizer: Any, tagging: bool = False, **options: Any) -> TaskRequest:
        """The prompt ids, grammar and parser of ``case`` (tagger and prompt labels when ``tagging``)."""

    # -- scoring --------------------------------------------------------------------------------------
    @abc.abstractmethod
    def case_fields(self, case: Any) -> dict:
        """The fields that open the case's row: ``id`` first, then what summaries group by."""

    @abc.abstractmethod
    def check(self, case: Any, output: Output, **options: Any) -> dict:
        """Score one output: the row's task fields, at least ``correct`` (bool) and ``error`` (str or None).

        ``output.error`` set: the case could not run; return it as wrong with that error."""

    @abc.abstractmethod
    def summarize(self, rows: list[dict]) -> dict:
        """The summary of finished rows: at least ``overall`` with ``n``, ``correct`` and :attr:`score_key`.

        The runner adds the measured budgets (:func:`measured_budgets`) after the task's keys."""

    @abc.abstractmethod
    def markdown(self, summary: dict, meta: dict | None = None) -> str:
        """``summary.md``: the summary as a markdown table (``meta``: model, policy, command, ...)."""

    # -- defaults a task may override -----------------------------------------------------------------
    def group(self, case: Any) -> str:
        """The case's group for screened calibration (BFCL category, SQL difficulty)."""
        return "all"

    def check_fit(self, split: str, options: Mapping[str, Any]) -> None:
        """PaskError unless these cases may be used to fit a method (calibration): never the test split
        (nor ``all``, which holds it)."""
        if split in ("test", "all"):
            raise PaskError(f"fitting on split '{split}' would leak the test split: use --split calibration (or dev)")

    def run_record(self, limit: int | None, options: Mapping[str, Any]) -> dict:
        """What ``pask eval``'s run record (summary.json ``run``) says about the cases beyond
        model, policy, budget and split: the limit and the options that differ from their defaults."""
        given = {k: str(v) if isinstance(v, Path) else v for k, v in options.items() if v != self.options.get(k)}
        return {"limit": limit, **given}

    def resolve_options(self, given: Mapping[str, Any]) -> dict:
        """The task's options with ``given`` (``None``: the default) filled in; PaskError for an unknown one."""
        if unknown := sorted(k for k, v in given.items() if v is not None and k not in self.options):
            known = ", ".join(sorted(self.options)) or "none"
            raise PaskError(f"task {self.name} has no option(s) {', '.join(unknown)} (its options: {known})")
        out = {k: list(v) if isinstance(v, list) else v for k, v in self.options.items()}  # defaults stay unshared
        out.update({k: v for k, v in given.items() if v is not None})
        return out


def measured_budgets(rows: list[dict]) -> dict:
    """Mean measured B over the cases (total, prompt tokens only, generated tokens only); 1.0 for Full KV."""

    def mean(key: str) -> float:
        vals = [r["budget"][key] for r in rows if r.get("budget") and r["budget"].get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else 1.0

    return {"measured_b": mean("b_total"), "measured_b_prompt": mean("b_prompt"), "measured_b_decode": mean("b_decode")}


def table_lines(head: list[str], cells: list[str], ns: list[str], meta: dict | None) -> list[str]:
    """The markdown table of a summary: optional command line, header, one result row, the n row."""
    lines = []
    if (meta or {}).get("command"):
        lines += [f"Command: `{meta['command']}`", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), "| " + " | ".join(cells) + " |"]
    lines += ["| " + " | ".join(ns) + " |", ""]
    return lines


__all__ = ["COMMON_SPLITS", "Output", "Task", "TaskRequest", "measured_budgets", "table_lines"]
