"""Data sources for `ctxext eval`: text files and folders, the offline Shakespeare texts, and `datasets`
(an in-process Dataset, a save_to_disk folder, a json file) through the same code path as the hub presets."""

import json

import datasets
import pytest
from transformers import AutoTokenizer

from ctxext.errors import CtxextError
from ctxext.eval.data import PRESETS, dataset_texts, load_documents, tokenizer_adds_bos


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def token_count(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_text_files_and_folders(tokenizer, tmp_path):
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "b.txt").write_text("second document " * 30)
    (tmp_path / "docs" / "sub" / "a.txt").write_text("first document " * 10)
    (tmp_path / "docs" / "notes.md").write_text("not a .txt file")
    single = tmp_path / "single.txt"
    single.write_text("a single file " * 20)
    docs = load_documents(tokenizer, text_files=[str(tmp_path / "docs"), str(single)])
    assert [d.name.split("/")[-1] for d in docs.documents] == ["b.txt", "a.txt", "single.txt"]
    assert [len(d) for d in docs.documents] == [
        token_count(tokenizer, ("second document " * 30)),
        token_count(tokenizer, "first document " * 10),
        token_count(tokenizer, "a single file " * 20),
    ]
    kept = load_documents(tokenizer, text_files=[str(tmp_path / "docs")], min_doc_tokens=40, max_docs=5)
    assert [d.name.split("/")[-1] for d in kept.documents] == ["b.txt"] and kept.dropped_short == 1
    assert load_documents(tokenizer, text_files=[str(tmp_path / "docs")], max_docs=1).describe()["documents"] == 1


def test_shakespeare_spec_joins_with_plus_and_splits_with_comma(tokenizer):
    from ctxext import assets

    docs = load_documents(tokenizer, dataset="shakespeare:hamlet_gut+richard_iii_gut,othello_gut")
    assert [d.name for d in docs.documents] == ["hamlet_gut+richard_iii_gut", "othello_gut"]
    stream = tokenizer(assets.shakespeare_text(assets.HAMLET_RICHARD3), add_special_tokens=False).input_ids
    assert docs.documents[0].ids.tolist() == stream
    every = load_documents(tokenizer, dataset="shakespeare", max_docs=3)
    assert all(not d.name.endswith("_f") for d in every.documents) and len(every.documents) == 3


def test_in_process_dataset_goes_through_the_preset_path():
    rows = datasets.Dataset.from_dict({"report": ["one", "", "three"], "summary": ["x", "y", "z"]})
    assert list(dataset_texts(rows, "report", False, "gov")) == [("gov[0]", "one"), ("gov[2]", "three")]
    assert list(dataset_texts(rows, "report", True, "wiki")) == [("wiki (all rows)", "one\n\n\n\nthree")]
    with pytest.raises(CtxextError, match="no text field 'text'.*report, summary"):
        list(dataset_texts(rows, None, False, "gov"))
    streamed = rows.to_iterable_dataset()
    assert [t for _, t in dataset_texts(streamed, "report", False, "gov")] == ["one", "three"]


def test_local_dataset_folder_and_json_file(tokenizer, tmp_path):
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ["train text " * 5]}),
            "test": datasets.Dataset.from_dict({"text": ["test text " * 7, "more test text " * 3]}),
        }
    )
    splits.save_to_disk(str(tmp_path / "saved"))
    docs = load_documents(tokenizer, dataset=str(tmp_path / "saved"))
    assert [len(d) for d in docs.documents] == [
        token_count(tokenizer, "test text " * 7),
        token_count(tokenizer, "more test text " * 3),
    ]
    assert docs.source["split"] == "test"
    train = load_documents(tokenizer, dataset=str(tmp_path / "saved"), split="train")
    assert len(train.documents) == 1
    with pytest.raises(CtxextError, match="no split 'dev'"):
        load_documents(tokenizer, dataset=str(tmp_path / "saved"), split="dev")

    lines = tmp_path / "books.jsonl"
    lines.write_text("\n".join(json.dumps({"body": f"book {i} " * 20}) for i in range(3)))
    docs = load_documents(tokenizer, dataset=str(lines), text_field="body", max_docs=2)
    assert [d.name for d in docs.documents] == [f"{lines}[0]", f"{lines}[1]"]
    with pytest.raises(CtxextError, match="no text field 'text'"):
        load_documents(tokenizer, dataset=str(lines))


def test_presets_name_real_splits_and_fields_and_fail_clearly_offline(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert PRESETS["govreport"].field == "report" and PRESETS["pg19"].split == "test"
    with pytest.raises(CtxextError, match="could not load dataset 'pg19'.*offline"):
        load_documents(tokenizer, dataset="pg19")


def test_bos_detection(tokenizer, smollm2_path):
    assert tokenizer_adds_bos(tokenizer) is False  # SmolLM2 adds none
    with_bos = AutoTokenizer.from_pretrained(smollm2_path)
    with_bos.add_bos_token = True
    assert with_bos("a").input_ids[0] == with_bos.bos_token_id
    assert tokenizer_adds_bos(with_bos) is True


def test_a_bug_while_loading_a_dataset_surfaces_and_a_missing_dataset_is_one_line(tokenizer, monkeypatch):
    """Only what loading can be expected to raise becomes a one-line error; anything else is a bug to see."""
    import datasets

    def missing(*args, **kwargs):
        raise datasets.exceptions.DatasetNotFoundError("Dataset 'someone/nothing' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(CtxextError, match="could not load dataset 'someone/nothing': Dataset .* doesn't exist"):
        load_documents(tokenizer, dataset="someone/nothing")

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(datasets, "load_dataset", bug)
    with pytest.raises(ZeroDivisionError):
        load_documents(tokenizer, dataset="someone/nothing")
