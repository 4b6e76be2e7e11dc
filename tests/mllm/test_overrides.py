"""The one parser of FIELD=VALUE (`--set`, `--space`, `--grid`, `--tag`) and the typed overrides it
makes: a malformed item is one line naming it and its form, values keep their text until applied,
and the JSON form that Prefect stores is the `FIELD=VALUE` texts, which validate back."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from mllm import UserError, storage
from mllm.resolve import NO_OVERRIDES, Overrides, field_value, resolve


@pytest.mark.parametrize("item", ["train.lr", "=3e-4", " =1", "train..lr=1", ".lr=1", "train.=1"])
def test_a_malformed_item_is_one_line_naming_it_the_option_and_the_form(item: str) -> None:
    with pytest.raises(UserError) as e:
        Overrides.parse([item])
    assert str(e.value) == f"malformed --set {item!r}: write it as section.field=value, e.g. train.lr=3e-4"
    with pytest.raises(UserError, match=r"^malformed --grid .*: write it as FIELD=v1,v2"):
        field_value(item, "--grid", "FIELD=v1,v2,...")


def test_a_field_is_stripped_and_a_value_kept_as_written_up_to_its_first_equals() -> None:
    assert field_value(" train.lr =3e-4 ", "--set", "") == ("train.lr", "3e-4 ")
    assert field_value("data.source=https://h/x?a=b", "--set", "") == ("data.source", "https://h/x?a=b")
    assert field_value("train.lr=", "--set", "") == ("train.lr", "")
    # A tag's key is no config field: dots as the user likes them, only the key and `=` are needed.
    assert field_value("team..a=x", "--tag", "key=value", dotted=False) == ("team..a", "x")
    with pytest.raises(UserError, match="malformed --tag 'team'"):
        field_value("team", "--tag", "key=value", dotted=False)


def test_overrides_apply_in_order_each_value_read_as_yaml_except_in_text_fields() -> None:
    sets = Overrides.parse(["train.lr=1e-3", "train.lr=3e-4", "sample.methods=[greedy]", "data.sha256=" + "1" * 64])
    assert sets.fields == {"train.lr", "sample.methods", "data.sha256"} and len(sets) == 4
    cfg = resolve("smoke", overrides=sets)
    assert cfg.train.lr == 3e-4 and cfg.sample.methods == ["greedy"]  # the later of a field wins
    assert cfg.data.sha256 == "1" * 64  # digits stay text in a text field
    # A point of a sweep, a trial's draw: the fixed overrides, then the point's fields.
    assert resolve("smoke", overrides=sets.with_values({"train.lr": "0.5"})).train.lr == 0.5
    assert resolve("smoke", overrides=["train.lr=0.25"]).train.lr == 0.25  # texts, as a script gives them
    assert not NO_OVERRIDES and Overrides() == NO_OVERRIDES


def test_the_json_form_is_the_texts_and_validates_back_the_same() -> None:
    texts = ["train.lr=3e-4", "data.source=s3://bucket/a,b"]
    sets = Overrides.parse(texts)
    assert json.loads(sets.model_dump_json()) == texts == sets.items()
    assert Overrides.model_validate(json.loads(sets.model_dump_json())) == sets
    assert Overrides.model_json_schema()["items"]["type"] == "string"  # a deployment's form: a list of texts
    # A form's malformed item (no CLI option to name) says "override".
    with pytest.raises(ValidationError, match="malformed override 'train.lr': write it as section.field=value"):
        Overrides.model_validate(["train.lr=1", "train.lr"])


def test_credentials_in_values_are_kept_in_memory_and_out_of_the_texts() -> None:
    url = "https://someone:hunter2@example.invalid/corpus.txt"
    sets = Overrides.parse([f"data.source={url}", "train.lr=1e-3"]).without_credentials()
    assert sets.items() == ["data.source=https://example.invalid/corpus.txt", "train.lr=1e-3"]
    assert "hunter2" not in sets.model_dump_json()
    # The download still authenticates: the password stays in this process for that URL.
    auth = storage.storage_options("https://example.invalid/corpus.txt")["client_kwargs"]["auth"]
    assert (auth.login, auth.password) == ("someone", "hunter2")
