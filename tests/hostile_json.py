"""Hypothesis strategies for the JSON a hostile member sends: a valid message with some of its values replaced by
wrong types, NaN, huge or subnormal numbers, odd unicode (lone surrogates, controls, bidi overrides), long strings
and nesting, an unknown key added, or the text cut short; and bytes that are no JSON at all."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

from hypothesis import strategies as st

# Characters a reader may choke on or print as something else: lone surrogates (JSON escapes no UTF-8 encodes), NUL,
# a bidi override, line breaks (a refusal or a log line spanning lines), a BOM, a character outside the BMP, a
# combining accent and a terminal escape sequence.
ODD_CHARACTERS = ("\ud800", "\udfff", "\x00", "\u202e", "\n", "\r\n", "\ufeff", "\U0001d518", "\u2028", "e\u0301",
                  "\x1b[2J")
odd_text = st.lists(st.one_of(st.sampled_from(ODD_CHARACTERS), st.text(max_size=3)), max_size=4).map("".join)
# What a refusal must not carry of the sender's text: a line break, a control or format character (an escape
# sequence, a bidi override) or a lone surrogate, which would forge a log line or disguise the text where it is shown.
_UNSHOWABLE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def one_showable_line(text: str) -> bool:
    """Whether `text` shows as itself on one line (hearth/protocol/display_text.py escapes what would not)."""
    return not any(unicodedata.category(character) in _UNSHOWABLE for character in text)

# JSON values as text, where json.dumps cannot write them: NaN, infinities, numbers past a double or a 64-bit
# integer, more digits than Python converts (4300), dates at the calendar's ends, long strings.
RAW_VALUES = ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1e-320", "-0.0", "1099511627777",
              "18446744073709551616", "-9223372036854775809", "9" * 5000, "true", "false", "null", "[]", "{}",
              json.dumps("x" * 3000), '"9999-12-31T23:59:59-23:59"', '"0001-01-01T00:00:00+23:59"', "253402300800")



def _json_text(depth: int) -> st.SearchStrategy[str]:
    leaves = st.one_of(st.sampled_from(RAW_VALUES), st.integers(-(2**70), 2**70).map(str),
                       odd_text.map(json.dumps), st.floats().map(json.dumps))
    if depth >= 2:
        return leaves
    inner = _json_text(depth + 1)
    return st.one_of(
        leaves,
        st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
        st.dictionaries(odd_text, inner, max_size=3).map(
            lambda members: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in members.items()) + "}"),
    )


# Any JSON value, as text (built once: a strategy made anew on every draw costs more than the test itself).
json_text = _json_text(0)
# Values a message may well hold, at their extremes: numbers at the bounds of what a field takes or just past them,
# odd text of a field's usual length.
extreme_values = st.one_of(
    st.sampled_from(["0", "1", "-1", "-0.0", "1e-300", "5e-324", "1.7976931348623157e308", "1099511627776",
                     "1099511627777", "2147483647", "4294967296", "9007199254740993", "0.5", '""']),
    odd_text.map(json.dumps))


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in `value` (dict keys and list indices from its root), the root first."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += _paths(item, prefix + (index,))
    return found


def _rendered(value: Any, replaced: dict[tuple, str | None], at: tuple = ()) -> str:
    """`value` as JSON text, with the text at each place in `replaced` instead (None: the member left out), and
    replaced places a dict does not have added as its members."""
    if at in replaced:
        return replaced[at]  # type: ignore[return-value]
    if isinstance(value, dict):
        keys = list(value) + [place[-1] for place in replaced
                              if len(place) == len(at) + 1 and place[:-1] == at and place[-1] not in value]
        members = [(key, _rendered(value.get(key), replaced, at + (key,))) for key in keys]
        return "{" + ",".join(f"{json.dumps(key)}:{text}" for key, text in members if text is not None) + "}"
    if isinstance(value, list):
        items = [_rendered(item, replaced, at + (index,)) for index, item in enumerate(value)]
        return "[" + ",".join(text for text in items if text is not None) + "]"
    return json.dumps(value)


def _damaged(message: dict, values: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    places = _paths(message)
    values = st.one_of(st.none(), values, values, values, values)  # None: the member left out
    replaced = (st.dictionaries(st.sampled_from(places[1:]), values, min_size=1, max_size=3) if places[1:]
                else st.just({}))
    objects = [place for place in places if isinstance(_value_at(message, place), dict)]
    added = st.one_of(st.just({}), st.builds(lambda place, key, text: {place + (key,): text},
                                             st.sampled_from(objects), odd_text, json_text))
    cut = st.one_of(st.none(), st.none(), st.none(), st.floats(0, 1))
    return st.builds(lambda changes, more, cut_at: _cut(_rendered(message, {**changes, **more}), cut_at),
                     replaced, added, cut)


def _cut(text: str, at: float | None) -> bytes:
    if at is not None:
        text = text[:int(at * len(text))]
    return text.encode("utf-8", "surrogatepass")


def damaged_json(valid_messages: list[dict], values: st.SearchStrategy[str] = json_text) -> st.SearchStrategy[bytes]:
    """One of `valid_messages` with up to three of its values replaced by `values` (JSON text) or left out, sometimes
    a key no model knows added, sometimes cut short; as UTF-8 (lone surrogates written as JSON escapes)."""
    return st.one_of(*(_damaged(message, values) for message in valid_messages))


def _value_at(value: Any, place: tuple) -> Any:
    for step in place:
        value = value[step]
    return value


def nested(depth: int, *, inside: str = "") -> str:
    """JSON arrays nested `depth` deep."""
    return "[" * depth + inside + "]" * depth


def hostile_body(valid_messages: list[dict], *, deep_field: str,
                 values: st.SearchStrategy[str] = json_text) -> st.SearchStrategy[bytes]:
    """Mostly a valid message damaged with `values`; else any JSON value, any bytes, or a valid message's `deep_field`
    nested past what any parser goes."""
    deep = st.sampled_from([60, 300, 100_000]).map(
        lambda depth: (_rendered(valid_messages[0], {(deep_field,): nested(depth)})).encode())
    damaged = damaged_json(valid_messages, values)
    return st.one_of(damaged, damaged, damaged, json_text.map(lambda text: text.encode("utf-8", "surrogatepass")),
                     st.binary(max_size=64), deep)
