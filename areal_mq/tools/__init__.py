"""Tools an episode can use, async and bounded (issue 62): `python` (the code sandbox) and `search` (BM25).

base.py         ToolResult, ToolLimits, argument validation against a tool's JSON schema
registry.py     ToolRegistry: openai_tools(names), dispatch(tool_call), call(name, arguments); never raises
python_tool.py  PythonTool: the code rewards' sandbox, in a bounded thread pool (the event loop keeps running)
bm25.py         Okapi BM25 (k1 = 1.5, b = 0.75) and the tokenizer;  search.py  the corpus loader, SearchTool
workflow.py     <tool_call> parsing and the call loop a workflow uses (tool_episode)
docs/tools.md shows a workflow and an endpoint agent using them.
"""
from areal_mq.tools.base import ToolLimits, ToolResult
from areal_mq.tools.bm25 import BM25, tokenize
from areal_mq.tools.python_tool import PythonTool
from areal_mq.tools.registry import ToolRegistry, default_tools
from areal_mq.tools.search import SAMPLE_CORPUS, SAMPLE_QUESTIONS, Corpus, CorpusError, SearchTool, load_corpus
from areal_mq.tools.workflow import answer_call, pending_tool_call, tool_episode

__all__ = ["BM25", "Corpus", "CorpusError", "PythonTool", "SAMPLE_CORPUS", "SAMPLE_QUESTIONS", "SearchTool",
           "ToolLimits", "ToolRegistry", "ToolResult", "answer_call", "default_tools", "load_corpus",
           "pending_tool_call", "tokenize", "tool_episode"]
