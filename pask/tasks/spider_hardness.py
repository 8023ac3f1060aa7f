"""Spider's difficulty buckets (easy / medium / hard / extra) from a parsed ``sql`` tree.

Re-implements the counting rule of Spider's official ``evaluation.py`` (``eval_hardness``) on the
parsed form stored in ``dev.json``:

- ``components1``: one each for WHERE, GROUP BY, ORDER BY, LIMIT; one per extra FROM table (joins);
  one per ``or`` connective and per LIKE condition in FROM-ON / WHERE / HAVING.
- ``components2``: nested queries, i.e. subqueries used as a condition value in FROM-ON / WHERE /
  HAVING plus INTERSECT / UNION / EXCEPT right-hand sides (subqueries in FROM are not counted).
- ``others``: one each for more than one aggregate, more than one SELECT item, more than one WHERE
  condition, more than one GROUP BY column.

To give the same labels as the official script its two counting quirks are kept on purpose:
a negated WHERE condition counts as an aggregate (the script tests ``cond_unit[0]``, which is the
NOT flag), and every ``and``/``or`` connective of HAVING counts as an aggregate (the script runs
its aggregate test over the raw HAVING list, connectives included).
"""

from __future__ import annotations

from typing import Any

LEVELS = ("easy", "medium", "hard", "extra")
_LIKE_OP = 9  # index of "like" in Spider's WHERE_OPS
_SqlTree = dict[str, Any]


def _conditions(sql: _SqlTree) -> list[list]:
    """The condition units (every other item) of FROM-ON, WHERE and HAVING."""
    return sql["from"]["conds"][::2] + sql["where"][::2] + sql["having"][::2]


def _connectives(sql: _SqlTree) -> list[str]:
    return sql["from"]["conds"][1::2] + sql["where"][1::2] + sql["having"][1::2]


def _flagged(unit: Any) -> bool:
    """Spider's aggregate test: the first field of ``unit`` differs from 0 ("none")."""
    return unit[0] != 0


def components1(sql: _SqlTree) -> int:
    n = sum(1 for clause in ("where", "groupBy", "orderBy") if sql[clause])
    n += sql["limit"] is not None
    n += max(len(sql["from"]["table_units"]) - 1, 0)
    n += sum(1 for c in _connectives(sql) if c == "or")
    n += sum(1 for cond in _conditions(sql) if cond[1] == _LIKE_OP)
    return n


def components2(sql: _SqlTree) -> int:
    nested = sum(1 for cond in _conditions(sql) for value in cond[3:5] if isinstance(value, dict))
    return nested + sum(1 for op in ("intersect", "union", "except") if sql[op] is not None)


def others(sql: _SqlTree) -> int:
    aggregates = sum(_flagged(item) for item in sql["select"][1])
    aggregates += sum(_flagged(cond) for cond in sql["where"][::2])  # quirk: NOT flag
    aggregates += sum(_flagged(col) for col in sql["groupBy"])
    if sql["orderBy"]:
        for val_unit in sql["orderBy"][1]:
            aggregates += sum(_flagged(col) for col in val_unit[1:3] if col)
    aggregates += sum(_flagged(item) for item in sql["having"])  # quirk: connectives count
    n = int(aggregates > 1)
    n += len(sql["select"][1]) > 1
    n += len(sql["where"]) > 1
    n += len(sql["groupBy"]) > 1
    return n


def spider_hardness(sql: _SqlTree) -> str:
    """The Spider difficulty bucket of a parsed query: one of :data:`LEVELS`."""
    c1, c2, other = components1(sql), components2(sql), others(sql)
    if c1 <= 1 and other == 0 and c2 == 0:
        return "easy"
    if c2 == 0 and ((other <= 2 and c1 <= 1) or (c1 <= 2 and other < 2)):
        return "medium"
    if (c2 == 0 and ((other > 2 and c1 <= 2) or (2 < c1 <= 3 and other <= 2))) or (c1 <= 1 and other == 0 and c2 <= 1):
        return "hard"
    return "extra"
