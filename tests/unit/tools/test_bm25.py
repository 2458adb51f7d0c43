"""BM25 against numbers worked by hand, and the search tool's ranking over the shipped sample corpus.

Okapi BM25 as areal_mq/tools/bm25.py implements it (k1 = 1.5, b = 0.75; Lucene's idf):
    score(D, Q) = sum_q idf(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))
    idf(q)      = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5))
Run: pytest tests/unit/tools/test_bm25.py -q   (< 1 s)
"""
from __future__ import annotations

import asyncio
import json
import math

import pytest

from areal_mq.tools import SAMPLE_CORPUS, SAMPLE_QUESTIONS, BM25, SearchTool, ToolRegistry, load_corpus, tokenize

# N = 3 documents of 3, 6 and 3 tokens: avgdl = 12 / 3 = 4
DOCS = ["The cat sat.", "the DOG sat on the mat", "cat, cat; dog!"]
IDF_2_OF_3 = math.log(1 + (3 - 2 + 0.5) / (2 + 0.5))  # ln 1.6 = 0.470004: a term in 2 of the 3 documents
IDF_1_OF_3 = math.log(1 + (3 - 1 + 0.5) / (1 + 0.5))  # ln 2.6667 = 0.980829: a term in 1 of the 3
NORM_3 = 1.5 * (1 - 0.75 + 0.75 * 3 / 4)  # k1 * (1 - b + b |D| / avgdl) for |D| = 3: 1.21875
NORM_6 = 1.5 * (1 - 0.75 + 0.75 * 6 / 4)  # for |D| = 6: 2.0625


def test_tokenize_is_lowercase_word_runs():
    assert tokenize("The DOG's 2 cats, café_au-lait!") == ["the", "dog", "s", "2", "cats", "café", "au", "lait"]


def test_scores_equal_the_hand_worked_values():
    bm = BM25(DOCS, k1=1.5, b=0.75)
    assert bm.avgdl == 4.0 and bm.lengths == [3, 6, 3]
    cat = bm.scores("cat")
    # D0: f = 1 -> 0.470004 * 2.5 / (1 + 1.21875) = 0.529582;  D2: f = 2 -> 0.470004 * 5 / 3.21875 = 0.730103
    assert cat == pytest.approx({0: IDF_2_OF_3 * 2.5 / (1 + NORM_3), 2: IDF_2_OF_3 * 5 / (2 + NORM_3)}, rel=1e-12)
    assert cat[0] == pytest.approx(0.529582, abs=1e-6) and cat[2] == pytest.approx(0.730103, abs=1e-6)
    # "the" twice in the longer D1 still beats once in the short D0, but by less than double: 0.578466 vs 0.529582
    the = bm.scores("the")
    assert the[1] == pytest.approx(IDF_2_OF_3 * 5 / (2 + NORM_6), rel=1e-12) == pytest.approx(0.578466, abs=1e-6)
    # two terms add; "mat" (1 of 3) weighs more than "dog" (2 of 3): D1 = 0.383676 + 0.800677 = 1.184353
    both = bm.scores("dog mat mat")  # a repeated query term counts once
    assert both[1] == pytest.approx((IDF_2_OF_3 + IDF_1_OF_3) * 2.5 / (1 + NORM_6), rel=1e-12)
    assert both[1] == pytest.approx(1.184353, abs=1e-6) and both[2] == pytest.approx(0.529582, abs=1e-6)
    assert bm.top("dog mat", 5) == [(1, both[1]), (2, both[2])]  # D0 has neither word: not returned
    assert bm.top("unicorn", 5) == [] and bm.scores("") == {}


def test_b_zero_ignores_length_and_k1_zero_ignores_frequency():
    flat = BM25(DOCS, k1=1.5, b=0.0).scores("the")
    assert flat[0] == pytest.approx(IDF_2_OF_3 * 2.5 / 2.5) and flat[1] == pytest.approx(IDF_2_OF_3 * 5 / 3.5)
    binary = BM25(DOCS, k1=0.0, b=0.75).scores("cat")
    assert binary[0] == pytest.approx(IDF_2_OF_3) == pytest.approx(binary[2])
    with pytest.raises(ValueError, match="0 <= b <= 1"):
        BM25(DOCS, b=1.5)


def test_sample_corpus_top_documents():
    """Each shipped question's source document ranks first, except one named distractor: the Festival of Lamps
    says "the year after the lighthouse was first lit", so it outranks the lighthouse's own page for the
    lighthouse's year (a model must read the snippets, as in Search-R1); it is second there."""
    corpus = load_corpus(SAMPLE_CORPUS)
    assert len(corpus.passages) == 40 and corpus.skipped == []
    tool = SearchTool(corpus)
    questions = [json.loads(line) for line in open(SAMPLE_QUESTIONS)]
    ranks = {q["id"]: [h["id"] for h in tool.search(q["question"], 3)].index(q["doc"]) for q in questions}
    assert {q: r for q, r in ranks.items() if r} == {"q1": 1}
    first = tool.search("In what year was the Harrowgate lighthouse first lit?", 2)
    assert [h["id"] for h in first] == ["festival-of-lamps", "harrowgate-lighthouse"]
    assert tool.search("puffins Holm cliffs", 1)[0]["id"] == "holm-island"


def test_search_tool_result_text_and_bounds():
    tool = SearchTool(load_corpus(SAMPLE_CORPUS), snippet_chars=80)
    reg = ToolRegistry([tool])
    r = asyncio.run(reg.call("search", {"query": "Tessel Bridge arches", "k": 2}))
    assert r.ok and r.reason == "" and len(r.data) == 2 and r.data[0]["id"] == "tessel-bridge"
    first = r.output.split("\n\n")[0]
    assert first.startswith("[1] Tessel Bridge (id tessel-bridge, score ") and first.endswith(" ...")
    assert all(len(h["snippet"]) <= 84 for h in r.data) and r.data[0]["score"] > r.data[1]["score"] > 0
    none = asyncio.run(reg.call("search", {"query": "zebra quantum"}))
    assert none.ok and none.output == "no passage matches the query" and none.data == []
    for args, why in [({"query": "?!"}, "no words"), ({"query": "x", "k": 11}, "must be <= 10"),
                      ({"query": "x", "k": True}, "must be integer"),
                      ({"query": "x", "path": "/etc/passwd"}, "unknown argument 'path'"), ({}, "missing required")]:
        bad = asyncio.run(reg.call("search", args))
        assert not bad.ok and bad.reason == "bad_arguments" and why in bad.message, (args, bad)
