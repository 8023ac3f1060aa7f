"""Request features for MetaKV: what is known of a request before it decodes.

Both the fit (dev cells) and every use (``pask eval --policy meta``, ``pask serve``) compute them
from the same two things, the prompt's token ids and the semantic label of each prompt token
(:mod:`pask.structure.prompt_labels`), so a predictor never sees a feature a server could not
compute. The task-specific counts of issue 31 come from the labels: function calling labels tool
names ``function_name`` and schema keys ``parameter_key``, text-to-SQL labels tables and columns
the same way, so the number of runs of those labels counts tools / tables and parameters / columns,
and ``protected_content`` holds the question (plus the template's fixed text). The BFCL category
is not a feature: a server cannot see it (``n_names`` tells multiple from simple; parallel
requests differ only in the user's words).
"""

from __future__ import annotations

from collections.abc import Sequence

from pask.structure.tags import PromptLabel

LABELS = tuple(label.value for label in PromptLabel)
FEATURES = (
    "prompt_tokens",
    *(f"n_{name}" for name in LABELS),
    "schema_tokens",
    "schema_share",
    "n_names",  # runs of function_name tokens: tools (BFCL) / tables (SQL)
    "n_keys",  # runs of parameter_key tokens: parameters (BFCL) / columns (SQL)
)


def _runs(labels: Sequence, label: PromptLabel) -> int:
    runs, prev = 0, None
    for lab in labels:
        if lab == label and prev != label:
            runs += 1
        prev = lab
    return runs


def request_features(prompt_ids: Sequence[int], prompt_labels: Sequence | None) -> dict[str, float]:
    """The feature vector (:data:`FEATURES`) of a prompt; ``prompt_labels`` None: all protected content."""
    n = len(prompt_ids)
    labels = [PromptLabel(x) for x in prompt_labels] if prompt_labels is not None else []
    if labels and len(labels) != n:
        raise ValueError(f"{len(labels)} prompt labels for {n} prompt tokens")
    counts = dict.fromkeys(LABELS, 0)
    for lab in labels:
        counts[lab.value] += 1
    if not labels:
        counts[PromptLabel.PROTECTED_CONTENT.value] = n
    schema = n - counts[PromptLabel.PROTECTED_CONTENT.value]
    out: dict[str, float] = {"prompt_tokens": float(n)}
    out |= {f"n_{k}": float(v) for k, v in counts.items()}
    out["schema_tokens"] = float(schema)
    out["schema_share"] = schema / n if n else 0.0
    out["n_names"] = float(_runs(labels, PromptLabel.FUNCTION_NAME))
    out["n_keys"] = float(_runs(labels, PromptLabel.PARAMETER_KEY))
    return out
