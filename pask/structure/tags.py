"""Tag vocabularies (paper Table 5), prompt labels (Table 6) and the bucket key.

A generated token gets a :class:`Tag` = (class, role, state, next); a prompt
token gets a :class:`PromptLabel`. A :class:`Bucket` pairs either with a layer
group and is the key of the frozen policy table; ``str(bucket)`` is its short,
stable spelling in table files, e.g. ``"D|schema_bearing|required|critical|no_lookahead|g2"``
or ``"P|function_name|g0"``.

When one token spans several roles, its components are combined independently
by the fixed priorities below (the more protective value wins):

- class: schema_bearing > free_generation > pure_scaffold
- JSON role: dispatch_key > required > optional > scaffold_separator
- SQL role: relation > predicate > projection > outside_schema
- state: critical > boundary > stable
- next: lookahead_critical > no_lookahead
- prompt label: function_name > parameter_key > enum_constraint > type_constraint
  > schema_scaffold > protected_content

:data:`FALLBACK` (JSON) and :data:`SQL_FALLBACK` are what a tagger returns for a
token it cannot classify (unfollowable schema, bytes off the expected format).
They sit at the protective end of each vocabulary -- (schema_bearing, required,
critical, lookahead_critical), the tag of a required key's text, and
(schema_bearing, relation, critical, lookahead_critical) -- so an unclassified
token is kept like a schema decision point, never like scaffold. (JSON's
dispatch_key is left to the function name itself.)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum


class TagClass(StrEnum):
    """What a generated token's text is."""

    PURE_SCAFFOLD = "pure_scaffold"  # structure only: brackets, quotes, separators, markers, keywords
    SCHEMA_BEARING = "schema_bearing"  # names from the schema: function names, keys, tables, columns
    FREE_GENERATION = "free_generation"  # model-chosen content: argument values, SQL literals


class JsonRole(StrEnum):
    """Role of a generated JSON tool-call token."""

    SCAFFOLD_SEPARATOR = "scaffold_separator"
    REQUIRED = "required"
    OPTIONAL = "optional"
    DISPATCH_KEY = "dispatch_key"


class SqlRole(StrEnum):
    """Clause a generated SQL token belongs to."""

    PROJECTION = "projection"
    RELATION = "relation"
    PREDICATE = "predicate"
    OUTSIDE_SCHEMA = "outside_schema"


class State(StrEnum):
    """Decision weight of the token (JSON uses boundary/critical only)."""

    STABLE = "stable"
    BOUNDARY = "boundary"
    CRITICAL = "critical"


class Next(StrEnum):
    """Whether the element expected right after this token is a critical one."""

    LOOKAHEAD_CRITICAL = "lookahead_critical"
    NO_LOOKAHEAD = "no_lookahead"


class PromptLabel(StrEnum):
    """Semantic label of a prompt token (Table 6)."""

    PROTECTED_CONTENT = "protected_content"
    SCHEMA_SCAFFOLD = "schema_scaffold"
    FUNCTION_NAME = "function_name"  # SQL: table
    PARAMETER_KEY = "parameter_key"  # SQL: column
    TYPE_CONSTRAINT = "type_constraint"
    ENUM_CONSTRAINT = "enum_constraint"  # SQL: PRIMARY KEY, REFERENCES, NOT NULL, ...


Role = JsonRole | SqlRole

CLASS_PRIORITY = {TagClass.PURE_SCAFFOLD: 0, TagClass.FREE_GENERATION: 1, TagClass.SCHEMA_BEARING: 2}
ROLE_PRIORITY: dict[Role, int] = {
    JsonRole.SCAFFOLD_SEPARATOR: 0,
    JsonRole.OPTIONAL: 1,
    JsonRole.REQUIRED: 2,
    JsonRole.DISPATCH_KEY: 3,
    SqlRole.OUTSIDE_SCHEMA: 0,
    SqlRole.PROJECTION: 1,
    SqlRole.PREDICATE: 2,
    SqlRole.RELATION: 3,
}
STATE_PRIORITY = {State.STABLE: 0, State.BOUNDARY: 1, State.CRITICAL: 2}
NEXT_PRIORITY = {Next.NO_LOOKAHEAD: 0, Next.LOOKAHEAD_CRITICAL: 1}
LABEL_PRIORITY = {
    PromptLabel.PROTECTED_CONTENT: 0,
    PromptLabel.SCHEMA_SCAFFOLD: 1,
    PromptLabel.TYPE_CONSTRAINT: 2,
    PromptLabel.ENUM_CONSTRAINT: 3,
    PromptLabel.PARAMETER_KEY: 4,
    PromptLabel.FUNCTION_NAME: 5,
}


@dataclass(frozen=True, slots=True)
class Tag:
    """Structural tag of one generated token: (class, role, state, next)."""

    cls: TagClass
    role: Role
    state: State
    next: Next

    def __str__(self) -> str:
        return f"{self.cls}|{self.role}|{self.state}|{self.next}"

    @property
    def is_sql(self) -> bool:
        return isinstance(self.role, SqlRole)

    @classmethod
    def parse(cls, text: str) -> Tag:
        """Inverse of ``str(tag)``."""
        c, r, s, n = text.split("|")
        role: Role = JsonRole(r) if r in JsonRole._value2member_map_ else SqlRole(r)
        return cls(TagClass(c), role, State(s), Next(n))


FALLBACK = Tag(TagClass.SCHEMA_BEARING, JsonRole.REQUIRED, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)
SQL_FALLBACK = Tag(TagClass.SCHEMA_BEARING, SqlRole.RELATION, State.CRITICAL, Next.LOOKAHEAD_CRITICAL)


def combine(tags: Iterable[Tag]) -> Tag:
    """Component-wise most protective tag (the documented priorities); tags must share a vocabulary."""
    tags = list(tags)
    if not tags:
        raise ValueError("combine() needs at least one tag")
    return Tag(
        max((t.cls for t in tags), key=CLASS_PRIORITY.__getitem__),
        max((t.role for t in tags), key=ROLE_PRIORITY.__getitem__),
        max((t.state for t in tags), key=STATE_PRIORITY.__getitem__),
        max((t.next for t in tags), key=NEXT_PRIORITY.__getitem__),
    )


def combine_labels(labels: Iterable[PromptLabel]) -> PromptLabel:
    """Most specific label (the documented priority); protected_content when empty."""
    return max(labels, key=LABEL_PRIORITY.__getitem__, default=PromptLabel.PROTECTED_CONTENT)


def json_tags() -> Iterator[Tag]:
    """Every tag the JSON tagger can emit (states boundary/critical)."""
    for c, r, s, n in itertools.product(TagClass, JsonRole, (State.BOUNDARY, State.CRITICAL), Next):
        yield Tag(c, r, s, n)


def sql_tags() -> Iterator[Tag]:
    """Every tag the SQL tagger can emit."""
    for c, r, s, n in itertools.product(TagClass, SqlRole, State, Next):
        yield Tag(c, r, s, n)


def layer_group(layer: int, num_layers: int, groups: int = 4) -> int:
    """Group of ``layer`` when ``num_layers`` contiguous layers are split into ``groups`` near-equal groups."""
    if not 0 <= layer < num_layers or groups < 1:
        raise ValueError(f"layer {layer} out of range for {num_layers} layers / {groups} groups")
    return layer * min(groups, num_layers) // num_layers


@dataclass(frozen=True, slots=True)
class Bucket:
    """Key of the frozen table: a decode tag or a prompt label, in one layer group."""

    item: Tag | PromptLabel
    group: int

    def __str__(self) -> str:
        if isinstance(self.item, Tag):
            return f"D|{self.item}|g{self.group}"
        return f"P|{self.item}|g{self.group}"

    @classmethod
    def parse(cls, text: str) -> Bucket:
        """Inverse of ``str(bucket)``."""
        head, _, rest = text.partition("|")
        body, _, g = rest.rpartition("|")
        if not g.startswith("g") or not g[1:].isdigit():
            raise ValueError(f"bad bucket '{text}': no layer group")
        if head == "D":
            return cls(Tag.parse(body), int(g[1:]))
        if head == "P":
            return cls(PromptLabel(body), int(g[1:]))
        raise ValueError(f"bad bucket '{text}': expected 'D|...' or 'P|...'")
