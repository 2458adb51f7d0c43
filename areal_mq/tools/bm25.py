"""Okapi BM25 over a list of passages: the ranking of the `search` tool, in pure Python.

What: `BM25([text, ...], k1=1.5, b=0.75).top(query, k)` -> [(passage index, score), ...] best first.
Scoring (Robertson and Zaragoza, "The Probabilistic Relevance Framework: BM25 and Beyond", 2009; the idf is
Lucene's, which never goes negative):

    score(D, Q) = sum over distinct terms q of Q:  idf(q) * f(q, D) * (k1 + 1) / (f(q, D) + k1 * (1 - b + b * |D| / avgdl))
    idf(q)      = ln(1 + (N - n(q) + 0.5) / (n(q) + 0.5))

f(q, D) is how often q occurs in D, |D| the number of tokens of D, avgdl the mean |D| over the N passages,
n(q) the number of passages containing q. A query term repeated counts once. Tokens are lowercase word
tokens (`tokenize`): runs of letters and digits, so "Veltran's" is "veltran", "s".
Why pure Python: no dependency, no download, and a sample corpus of dozens of passages (or a user's of
thousands) scores in milliseconds through the inverted index (only passages holding a query term are scored).
"""
from __future__ import annotations

import math
import re
from collections import Counter

_WORD = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens: maximal runs of letters and digits (any script); everything else separates."""
    return _WORD.findall(text.lower())


class BM25:
    def __init__(self, passages: list[str], k1: float = 1.5, b: float = 0.75):
        if k1 < 0 or not 0 <= b <= 1:
            raise ValueError(f"BM25 needs k1 >= 0 and 0 <= b <= 1 (got k1={k1}, b={b})")
        self.k1, self.b = k1, b
        self.lengths = []
        self.postings: dict[str, list[tuple[int, int]]] = {}  # term -> [(passage, term frequency)]
        for i, text in enumerate(passages):
            counts = Counter(tokenize(text))
            self.lengths.append(sum(counts.values()))
            for term, tf in counts.items():
                self.postings.setdefault(term, []).append((i, tf))
        self.n = len(passages)
        self.avgdl = (sum(self.lengths) / self.n) if self.n else 0.0

    def idf(self, term: str) -> float:
        df = len(self.postings.get(term, ()))
        return math.log(1.0 + (self.n - df + 0.5) / (df + 0.5))

    def scores(self, query: str) -> dict[int, float]:
        """Score of every passage sharing at least one term with `query` (others score 0)."""
        out: dict[int, float] = {}
        avgdl = self.avgdl or 1.0
        for term in dict.fromkeys(tokenize(query)):  # distinct terms, in order
            postings = self.postings.get(term)
            if not postings:
                continue
            idf = self.idf(term)
            for i, tf in postings:
                norm = self.k1 * (1 - self.b + self.b * self.lengths[i] / avgdl)
                out[i] = out.get(i, 0.0) + idf * tf * (self.k1 + 1) / (tf + norm)
        return out

    def top(self, query: str, k: int) -> list[tuple[int, float]]:
        """The k best passages with a positive score, best first (ties: the earlier passage first)."""
        ranked = sorted(self.scores(query).items(), key=lambda item: (-item[1], item[0]))
        return [(i, s) for i, s in ranked[:k] if s > 0]
