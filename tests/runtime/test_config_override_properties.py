"""Property tests over ``--set KEY=VALUE``: any override gives a valid config or a UserError, never another
exception; a value of the wrong kind is never cast (no ``true`` as 1, no ``"3"`` as 3)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from grstack.runtime.errors import UserError
from grstack.runtime.training_config import Config, load_config

pytestmark = pytest.mark.unit

TINY = Path(__file__).resolve().parents[2] / "configs" / "synthetic-tiny-hstu.yaml"


def _leaves(model: type[BaseModel], prefix: str = "") -> dict[str, typing.Any]:
    out: dict[str, typing.Any] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_leaves(ann, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = ann
    return out


LEAVES = _leaves(Config)
SECTIONS = sorted({k.split(".")[0] for k in LEAVES if "." in k})

keys = st.one_of(
    st.sampled_from(sorted(LEAVES)),
    st.sampled_from(SECTIONS),
    st.builds(lambda s, k: f"{s}.{k}", st.sampled_from(SECTIONS), st.text(min_size=0, max_size=8)),
    st.text(min_size=1, max_size=20).filter(lambda t: "=" not in t),
)
values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["true", "false", "null", "~", "yes", "off", ".inf", "-.inf", ".nan", "1e-3", "1e400",
                     "[]", "{}", "[1, true]", "{a: 1}", "'3'", "\"x\"", "2024-01-01", "!!binary aGk=",
                     "!!python/object:os.system x", "&a [*a]", "", "a: b: c", "- x", "[", "\x00", "~/x"]),
    st.text(max_size=24),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=3))
def test_any_override_is_a_config_or_a_user_error(overrides: list[tuple[str, str]]) -> None:
    try:
        cfg = load_config(TINY, [f"{k}={v}" for k, v in overrides])
    except UserError as exc:
        assert str(exc) and "\n" not in str(exc).strip()
        return
    assert isinstance(cfg, Config)


def _kinds(ann: typing.Any) -> set[type]:
    args = typing.get_args(ann)
    if typing.get_origin(ann) is typing.Literal:
        return {type(a) for a in args}
    return set().union(*map(_kinds, args)) if args else ({ann} if isinstance(ann, type) else set())


NUMERIC = sorted(k for k, a in LEAVES.items()
                 if typing.get_origin(a) is not list and _kinds(a) & {int, float} and not _kinds(a) & {str, bool})
BOOLEAN = sorted(k for k, a in LEAVES.items() if _kinds(a) == {bool})


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(NUMERIC), st.sampled_from(["true", "false", "'3'", "\"1.5\"", "yes"]))
def test_a_number_field_takes_no_boolean_or_string(key: str, value: str) -> None:
    with pytest.raises(UserError, match=key.replace(".", r"\.") + ": expected"):
        load_config(TINY, [f"{key}={value}"])


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(BOOLEAN), st.sampled_from(["0", "1", "'true'", "2.0"]))
def test_a_boolean_field_takes_no_number_or_string(key: str, value: str) -> None:
    with pytest.raises(UserError, match=key.replace(".", r"\.") + ": expected true or false"):
        load_config(TINY, [f"{key}={value}"])


def test_text_fields_keep_what_was_typed_and_exponents_are_numbers() -> None:
    cfg = load_config(TINY, ["name=2024", "optim.lr=1e-3", "train.device=0"])
    assert (cfg.name, cfg.optim.lr, cfg.train.device) == ("2024", 1e-3, "0")
