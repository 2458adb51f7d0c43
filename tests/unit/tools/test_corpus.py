"""The corpus loader reads only regular files inside the corpus directory: symlinks leading out, symlinked
directories and FIFOs are skipped with the reason, never read; JSONL corpora, passage splitting, refusals.
Run: pytest tests/unit/tools/test_corpus.py -q   (< 1 s)
"""
from __future__ import annotations

import json
import os

import pytest

from areal_mq.tools import CorpusError, SearchTool, load_corpus

SECRET = "outside secret zanzibar"


@pytest.fixture
def tree(tmp_path):
    """corpus/ with two good files, a nested one, an inside symlink, and four escape or hang attempts."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET)
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("Alpha harbour facts.\nThe harbour wall is long.")
    (corpus / "b.md").write_text("# Beta Title\n\nBeta text about zebras.")
    (corpus / "sub" / "c.txt").write_text("Gamma text.")
    (corpus / "notes.bin").write_text("not a corpus suffix")
    os.symlink(corpus / "a.txt", corpus / "alias.txt")  # inside -> inside: fine
    os.symlink(outside / "secret.txt", corpus / "leak.txt")  # inside -> outside
    os.symlink("../../outside/secret.txt", corpus / "sub" / "relative-leak.md")  # a relative escape
    os.symlink(outside, corpus / "outdir")  # a symlinked directory
    os.mkfifo(corpus / "pipe.txt")  # opening it for reading would block a naive loader
    return corpus


def test_symlink_escapes_and_fifos_are_skipped_never_read(tree):
    c = load_corpus(str(tree))
    ids = [p.id for p in c.passages]
    assert ids == ["a.txt", "alias.txt", "b.md", "sub/c.txt"]
    assert all(SECRET not in p.text for p in c.passages)
    skipped = dict(s.split(": ", 1) for s in c.skipped)
    assert skipped == {"outdir": "symlinked directory, not followed",
                       "leak.txt": "a symlink leading outside the corpus directory, not read",
                       "sub/relative-leak.md": "a symlink leading outside the corpus directory, not read",
                       "pipe.txt": "not a regular file"}
    beta = c.passages[2]
    assert (beta.title, beta.text) == ("Beta Title", "Beta text about zebras.")
    assert (c.passages[0].title, c.passages[3].title) == ("a", "c")
    hits = SearchTool(c).search("outside secret zanzibar", 5)
    assert hits == []  # nothing of the outside file was indexed


def test_a_corpus_given_through_a_symlinked_root_is_read_from_its_real_place(tree, tmp_path):
    os.symlink(tree, tmp_path / "link-to-corpus")
    assert [p.id for p in load_corpus(str(tmp_path / "link-to-corpus")).passages][:2] == ["a.txt", "alias.txt"]


def test_jsonl_corpus_bad_lines_and_passage_splitting(tmp_path):
    path = tmp_path / "docs.jsonl"
    long_text = " ".join(f"w{i}" for i in range(25))
    path.write_text("\n".join([json.dumps({"id": "../../etc/passwd", "title": "T", "text": "ids are names only"}),
                               "{not json", json.dumps({"title": "no id or text"}), "",
                               json.dumps({"id": 7, "text": long_text})]) + "\n")
    c = load_corpus(str(path), passage_words=10)
    assert [(p.id, p.title) for p in c.passages] == [("../../etc/passwd", "T"), ("7", "7"), ("7#2", "7"), ("7#3", "7")]
    assert c.passages[3].text == "w20 w21 w22 w23 w24"
    assert c.skipped == ["line 2: not a JSON object with id and text (JSONDecodeError)",
                         "line 3: not a JSON object with id and text (KeyError)"]


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "docs.csv").write_text("id,text\n")
    with pytest.raises(CorpusError, match="must be .jsonl"):
        load_corpus(str(tmp_path / "docs.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="has no documents"):
        load_corpus(str(tmp_path / "empty"))
    big = tmp_path / "big"
    big.mkdir()
    (big / "huge.txt").write_text("x " * 600)
    (big / "ok.txt").write_text("small")
    c = load_corpus(str(big), max_file_bytes=1000)
    assert [p.id for p in c.passages] == ["ok.txt"]
    assert c.skipped == ["huge.txt: 1200 bytes, over max_file_bytes (1000)"]
