import hashlib
import json

import numpy as np
import pyarrow as pa
import pytest

from mllm import UserError
from mllm.data.vocab import Vocab

COUNTS = {"a": 5, "b": 3, "c": 3, "d": 1, " ": 9}


def test_order_unk_specials_then_by_count_then_token():
    v = Vocab.build(COUNTS, specials=["<eos>", "<pad>"])
    assert v.itos == ["<unk>", "<eos>", "<pad>", " ", "a", "b", "c", "d"]
    assert v.stoi["b"] == 5 and v.unk_id == 0 and len(v) == 8


def test_counted_unk_or_special_is_not_listed_twice():
    v = Vocab.build({"<unk>": 4, "<eos>": 2, "x": 1}, specials=["<eos>"])
    assert v.itos == ["<unk>", "<eos>", "x"]


def test_min_freq_and_max_size_counting_every_entry():
    assert Vocab.build(COUNTS, min_freq=3).itos == ["<unk>", " ", "a", "b", "c"]
    assert Vocab.build(COUNTS, max_size=3).itos == ["<unk>", " ", "a"]
    assert Vocab.build(COUNTS, max_size=3, specials=["<bos>"]).itos == ["<unk>", "<bos>", " "]
    with pytest.raises(UserError, match="max_size"):
        Vocab.build(COUNTS, max_size=2, specials=["<bos>", "<eos>"])


def test_token_order_keeps_ids_while_counts_change():
    """A growing corpus: counts shift (b overtakes a) but no token arrives, so ids stay; the
    most frequent still win the room max_size leaves."""
    before = Vocab.build({"a": 5, "b": 4, "c": 1}, specials=["<pad>"], order="token")
    after = Vocab.build({"a": 6, "b": 9, "c": 2}, specials=["<pad>"], order="token")
    assert before.itos == after.itos == ["<unk>", "<pad>", "a", "b", "c"]
    assert Vocab.build({"a": 6, "b": 9, "c": 2}, specials=["<pad>"]).itos == ["<unk>", "<pad>", "b", "a", "c"]
    assert Vocab.build({"z": 9, "a": 1, "m": 5}, max_size=3, order="token").itos == ["<unk>", "m", "z"]


def test_unknown_tokens_encode_to_unk():
    v = Vocab.build(COUNTS)
    assert v.encode(["a", "z", " ", "<unk>"]) == [2, 0, 1, 0]
    assert v.decode(v.encode(["a", "z"])) == ["a", "<unk>"]
    assert v.missing(["z", "a", "y", "z", "q"]) == ["z", "y", "q"]


def test_encode_array_matches_encode_for_arrow_inputs():
    v = Vocab.build(COUNTS)
    tokens = ["a", "q", " ", "d", "c", "a", "<unk>"]
    want = np.array(v.encode(tokens), dtype=np.int32)
    arr = pa.array(tokens)
    for given in (
        tokens,
        arr,
        pa.chunked_array([arr[:3], arr[3:]]),
        arr.cast(pa.large_string()),
        arr.dictionary_encode(),
    ):
        got = v.encode_array(given)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    assert v.encode_array([]).shape == (0,)


def test_decode_accepts_arrays_and_rejects_ids_outside():
    v = Vocab.build(COUNTS)
    assert v.decode(np.array([2, 1, 3], dtype=np.int32)) == ["a", " ", "b"]
    for bad in ([len(v)], [-1]):
        with pytest.raises(ValueError, match="outside"):
            v.decode(bad)


def test_json_round_trip_and_storage(tmp_path):
    v = Vocab.build({"é": 2, "☃": 1, '"': 1}, specials=["<eos>"])
    again = Vocab.from_json(v.to_json())
    assert again == v and again.itos == v.itos
    for url in (str(tmp_path / "sub" / "vocab.json"), "memory://vocab-test/vocab.json"):
        v.save(url)
        assert Vocab.load(url) == v
    state = json.loads((tmp_path / "sub" / "vocab.json").read_text(encoding="utf-8"))
    assert state["format"] == "mllm-vocab" and state["version"] == 1 and state["tokens"] == v.itos


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        "[1, 2, 3]",
        '{"tokens": ["<unk>"]}',
        '{"format": "mllm-vocab", "version": 2, "tokens": ["<unk>"]}',
        '{"format": "mllm-vocab", "version": 1, "tokens": ["a", "<unk>"]}',
        '{"format": "mllm-vocab", "version": 1, "tokens": ["<unk>", "a", "a"]}',
        '{"format": "mllm-vocab", "version": 1, "tokens": ["<unk>", 3]}',
        '{"format": "mllm-vocab", "version": 1}',
    ],
)
def test_from_json_on_other_input_is_a_user_error(bad):
    with pytest.raises(UserError):
        Vocab.from_json(bad)


def test_load_names_the_url_of_a_file_that_is_not_a_vocabulary(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"\x80\x04\x95 pickled bytes")
    with pytest.raises(UserError, match="model.pt"):
        Vocab.load(str(path))
    with pytest.raises(UserError, match="not found"):
        Vocab.load(str(tmp_path / "absent.json"))


def test_digest_is_stable_and_follows_the_tokens():
    v = Vocab.build(COUNTS)
    assert v.digest == Vocab.build(dict(reversed(COUNTS.items()))).digest
    assert v.digest == hashlib.sha256(v.to_json().encode()).hexdigest()
    assert v.digest != Vocab.build({**COUNTS, "e": 1}).digest
    swapped = Vocab([v.itos[0], v.itos[2], v.itos[1], *v.itos[3:]])
    assert swapped.digest != v.digest
