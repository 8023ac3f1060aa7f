"""Tag vocabularies, priorities, bucket keys and layer groups."""

from __future__ import annotations

import dataclasses

import pytest

from pask.structure.tags import (
    FALLBACK,
    SQL_FALLBACK,
    Bucket,
    JsonRole,
    Next,
    PromptLabel,
    SqlRole,
    State,
    Tag,
    TagClass,
    combine,
    combine_labels,
    json_tags,
    layer_group,
    sql_tags,
)


def test_vocabularies_match_table5():
    assert {c.value for c in TagClass} == {"pure_scaffold", "schema_bearing", "free_generation"}
    assert {r.value for r in JsonRole} == {"scaffold_separator", "required", "optional", "dispatch_key"}
    assert {r.value for r in SqlRole} == {"projection", "relation", "predicate", "outside_schema"}
    assert {s.value for s in State} == {"stable", "boundary", "critical"}
    assert {n.value for n in Next} == {"lookahead_critical", "no_lookahead"}
    assert {p.value for p in PromptLabel} == {
        "protected_content",
        "schema_scaffold",
        "function_name",
        "parameter_key",
        "type_constraint",
        "enum_constraint",
    }
    assert len(set(json_tags())) == 3 * 4 * 2 * 2
    assert len(set(sql_tags())) == 3 * 4 * 3 * 2
    assert all(t.state != State.STABLE for t in json_tags())


def test_fallbacks_are_most_protective_members():
    assert FALLBACK in set(json_tags()) and SQL_FALLBACK in set(sql_tags())
    top = combine(json_tags())
    assert (top.cls, top.state, top.next) == (FALLBACK.cls, FALLBACK.state, FALLBACK.next)
    assert FALLBACK.role == JsonRole.REQUIRED  # dispatch_key is left to the function name
    assert combine(sql_tags()) == SQL_FALLBACK


def test_tag_is_frozen_hashable_and_round_trips():
    for tag in [*json_tags(), *sql_tags()]:
        assert Tag.parse(str(tag)) == tag
        assert hash(Tag.parse(str(tag))) == hash(tag)
    with pytest.raises(dataclasses.FrozenInstanceError):
        FALLBACK.state = State.BOUNDARY  # type: ignore[misc]
    assert SQL_FALLBACK.is_sql and not FALLBACK.is_sql


def test_bucket_strings():
    tag = Tag(TagClass.SCHEMA_BEARING, JsonRole.REQUIRED, State.CRITICAL, Next.NO_LOOKAHEAD)
    assert str(Bucket(tag, 2)) == "D|schema_bearing|required|critical|no_lookahead|g2"
    assert str(Bucket(PromptLabel.FUNCTION_NAME, 0)) == "P|function_name|g0"
    items = [*json_tags(), *sql_tags(), *PromptLabel]
    buckets = {Bucket(item, g) for item in items for g in range(4)}
    assert len(buckets) == len(items) * 4
    for b in buckets:
        assert Bucket.parse(str(b)) == b
    for bad in ("X|function_name|g0", "P|function_name", "P|function_name|gx", "P|nope|g1", "D|a|b|g0"):
        with pytest.raises(ValueError):
            Bucket.parse(bad)


def test_combine_priorities():
    scaf = Tag(TagClass.PURE_SCAFFOLD, JsonRole.SCAFFOLD_SEPARATOR, State.BOUNDARY, Next.LOOKAHEAD_CRITICAL)
    value = Tag(TagClass.FREE_GENERATION, JsonRole.OPTIONAL, State.BOUNDARY, Next.NO_LOOKAHEAD)
    key = Tag(TagClass.SCHEMA_BEARING, JsonRole.REQUIRED, State.CRITICAL, Next.NO_LOOKAHEAD)
    name = Tag(TagClass.SCHEMA_BEARING, JsonRole.DISPATCH_KEY, State.BOUNDARY, Next.NO_LOOKAHEAD)
    assert combine([scaf, value]) == Tag(
        TagClass.FREE_GENERATION, JsonRole.OPTIONAL, State.BOUNDARY, Next.LOOKAHEAD_CRITICAL
    )
    assert combine([value, key]).role == JsonRole.REQUIRED
    assert combine([key, name]) == Tag(
        TagClass.SCHEMA_BEARING, JsonRole.DISPATCH_KEY, State.CRITICAL, Next.NO_LOOKAHEAD
    )
    order = [SqlRole.OUTSIDE_SCHEMA, SqlRole.PROJECTION, SqlRole.PREDICATE, SqlRole.RELATION]
    sql = [Tag(TagClass.PURE_SCAFFOLD, r, State.STABLE, Next.NO_LOOKAHEAD) for r in order]
    for i in range(4):
        assert combine(sql[: i + 1]).role == order[i]
        assert combine(reversed(sql[: i + 1])).role == order[i]
    assert combine(
        [sql[0], Tag(TagClass.FREE_GENERATION, SqlRole.PROJECTION, State.BOUNDARY, Next.NO_LOOKAHEAD)]
    ) == Tag(TagClass.FREE_GENERATION, SqlRole.PROJECTION, State.BOUNDARY, Next.NO_LOOKAHEAD)
    with pytest.raises(ValueError):
        combine([])


def test_label_priority():
    order = [
        PromptLabel.PROTECTED_CONTENT,
        PromptLabel.SCHEMA_SCAFFOLD,
        PromptLabel.TYPE_CONSTRAINT,
        PromptLabel.ENUM_CONSTRAINT,
        PromptLabel.PARAMETER_KEY,
        PromptLabel.FUNCTION_NAME,
    ]
    for i, lab in enumerate(order):
        assert combine_labels(order[: i + 1]) == lab
        assert combine_labels(reversed(order[: i + 1])) == lab
    assert combine_labels([]) == PromptLabel.PROTECTED_CONTENT


def test_layer_group():
    assert [layer_group(i, 24) for i in range(24)] == [g for g in range(4) for _ in range(6)]
    groups = [layer_group(i, 10, 4) for i in range(10)]
    assert groups == sorted(groups) and set(groups) == {0, 1, 2, 3}
    assert [layer_group(i, 3, 8) for i in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError):
        layer_group(24, 24)
    with pytest.raises(ValueError):
        layer_group(0, 24, 0)
