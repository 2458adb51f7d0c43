"""The `search` tool: BM25 over a local document set the operator provides (Search-R1-style tasks).

What: `SearchTool(load_corpus("my_docs/"))`; `await tool.call({"query": "who built the lighthouse", "k": 3})`
-> the top-k passages, each `[rank] title (id, score)` and a bounded snippet; ToolResult.data holds them as dicts
(id, title, score, snippet). A corpus is a directory of .txt / .md files (id: the path relative to the
directory; title: a leading `# heading` of a .md file, else the file name) or a JSONL file of {"id", "title",
"text"} lines. Documents longer than `passage_words` words are split into passages `id#2`, `id#3`, ...
SAMPLE_CORPUS (areal_mq/tools/data/sample_docs.jsonl) is a small shipped set of fictional facts, with questions
answerable from it in sample_questions.jsonl.
Paths: the model gives a query, never a path. The loader reads only regular files whose real path is inside the
corpus directory: a symlink leading out of it, a symlinked directory, a FIFO or device, a file over
max_file_bytes are skipped and listed in Corpus.skipped with the reason, never read.
"""
from __future__ import annotations

import asyncio
import json
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from areal_mq.errors import ConfigError
from areal_mq.tools.base import ToolResult, error
from areal_mq.tools.bm25 import BM25, tokenize

SAMPLE_CORPUS = str(Path(__file__).parent / "data" / "sample_docs.jsonl")
SAMPLE_QUESTIONS = str(Path(__file__).parent / "data" / "sample_questions.jsonl")
SUFFIXES = (".txt", ".md")


class CorpusError(ConfigError):
    """The corpus path is missing, empty or not a directory / JSONL file."""


@dataclass
class Passage:
    id: str
    title: str
    text: str


@dataclass
class Corpus:
    passages: list[Passage]
    source: str
    skipped: list[str] = field(default_factory=list)  # "what: why", for the operator's log


def load_corpus(path: str, *, passage_words: int = 120, max_file_bytes: int = 2_000_000) -> Corpus:
    """The passages of a directory of .txt/.md files or of a JSONL file (module docstring)."""
    if not os.path.exists(path):
        raise CorpusError(f"search corpus {path!r} does not exist; give a directory of .txt/.md files or a .jsonl "
                          f"of {{id, title, text}} (the sample: {SAMPLE_CORPUS})")
    docs, skipped = (_read_dir(path, max_file_bytes) if os.path.isdir(path) else _read_jsonl(path, max_file_bytes))
    passages = [p for doc in docs for p in _split(doc, passage_words)]
    if not passages:
        raise CorpusError(f"search corpus {path!r} has no documents (skipped: {skipped[:5]})")
    return Corpus(passages, path, skipped)


def _inside(root: str, real: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _read_dir(path: str, max_bytes: int) -> tuple[list[Passage], list[str]]:
    root = os.path.realpath(path)
    docs, skipped = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for d in sorted(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                skipped.append(f"{os.path.relpath(os.path.join(dirpath, d), root)}: symlinked directory, not followed")
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if not name.endswith(SUFFIXES):
                continue
            why, text = _read_file(root, full, max_bytes)
            if why:
                skipped.append(f"{rel}: {why}")
                continue
            docs.append(_document(rel, name, text))
    return docs, skipped


def _read_file(root: str, full: str, max_bytes: int) -> tuple[str, str]:
    """("", text) or (why it was not read, "")."""
    real = os.path.realpath(full)
    if not _inside(root, real):
        return "a symlink leading outside the corpus directory, not read", ""
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO must not block the loader
    except OSError as exc:
        return f"cannot open ({exc.strerror})", ""
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", ""
        if st.st_size > max_bytes:
            return f"{st.st_size} bytes, over max_file_bytes ({max_bytes})", ""
        return "", f.read(max_bytes).decode("utf-8", "replace")


def _document(rel: str, name: str, text: str) -> Passage:
    title, body = Path(name).stem, text
    first, _, rest = text.lstrip().partition("\n")
    if name.endswith(".md") and first.startswith("#"):
        title, body = first.lstrip("#").strip() or title, rest
    return Passage(rel, title, body.strip())


def _read_jsonl(path: str, max_bytes: int) -> tuple[list[Passage], list[str]]:
    if not path.endswith(".jsonl"):
        raise CorpusError(f"search corpus {path!r}: a file corpus must be .jsonl (one {{id, title, text}} per line)")
    if os.path.getsize(path) > max_bytes * 100:
        raise CorpusError(f"search corpus {path!r} is larger than {max_bytes * 100} bytes (100 x max_file_bytes)")
    docs, skipped = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                docs.append(Passage(str(row["id"]), str(row.get("title") or row["id"]), str(row["text"])))
            except (ValueError, KeyError, TypeError) as exc:
                skipped.append(f"line {n}: not a JSON object with id and text ({type(exc).__name__})")
    return docs, skipped


def _split(doc: Passage, words: int) -> list[Passage]:
    parts = doc.text.split()
    if len(parts) <= words:
        return [doc] if parts else []
    chunks = [" ".join(parts[i:i + words]) for i in range(0, len(parts), words)]
    return [Passage(doc.id if k == 0 else f"{doc.id}#{k + 1}", doc.title, c) for k, c in enumerate(chunks)]


class SearchTool:
    name = "search"
    description = ("Search the document collection for passages about a topic (keyword ranking, BM25). "
                   "Returns the best passages with their titles; ask with the words you expect in the answer.")

    def __init__(self, corpus: Corpus, *, k1: float = 1.5, b: float = 0.75, default_k: int = 3, max_k: int = 10,
                 snippet_chars: int = 600):
        self.corpus, self.default_k, self.snippet_chars = corpus, default_k, snippet_chars
        self.index = BM25([f"{p.title}\n{p.text}" for p in corpus.passages], k1=k1, b=b)  # titles count as words
        self.parameters = {"type": "object", "additionalProperties": False, "required": ["query"], "properties": {
            "query": {"type": "string", "minLength": 1, "maxLength": 1000, "description": "what to look for"},
            "k": {"type": "integer", "minimum": 1, "maximum": max_k,
                  "description": f"how many passages (default {default_k})"}}}

    def search(self, query: str, k: int | None = None) -> list[dict]:
        """The top-k hits as dicts {id, title, score, snippet}, best first."""
        hits = self.index.top(query, k or self.default_k)
        return [{"id": self.corpus.passages[i].id, "title": self.corpus.passages[i].title, "score": round(s, 4),
                 "snippet": _snippet(self.corpus.passages[i].text, self.snippet_chars)} for i, s in hits]

    async def call(self, arguments: dict) -> ToolResult:
        query = arguments["query"]
        if not tokenize(query):
            return error(self.name, "bad_arguments", "the query has no words to search for")
        hits = await asyncio.to_thread(self.search, query, arguments.get("k"))  # a large corpus must not stall the loop
        if not hits:
            return ToolResult(self.name, True, "no passage matches the query", data=[])
        text = "\n\n".join(f"[{n}] {h['title']} (id {h['id']}, score {h['score']:.2f})\n{h['snippet']}"
                           for n, h in enumerate(hits, 1))
        return ToolResult(self.name, True, text, data=hits)


def _snippet(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut + " ..."
