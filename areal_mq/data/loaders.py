"""Load problems from JSONL, Parquet or `datasets` sources (sources.py) into `Problem` records.

What: four record layouts, whatever the storage (a JSONL line, a Parquet row, a `datasets` row).
- `arith`  the built-in task (areal_mq/data/arith_*.jsonl): `question`, `answer` (number), `level`, `id`.
- `gsm8k`  GSM8K layout: `question`, and `answer` = worked solution ending in "#### N" (N may have commas).
- `math`   Hendrycks MATH: `problem`, `solution` (answer = its last \\boxed{...}, braces matched), `level`
           ("Level 5"; "Level ?" = none), `type` (subject). MATH-500 (HuggingFaceH4/MATH-500): `problem`,
           `solution`, `answer` (used as is), `subject`, `level` (int), `unique_id` (the id).
- `jsonl`  any records: the user prompt is `prompt_template` with `{field}` placeholders filled from the record,
           the reference answer is `record[answer_field]`.
Each layout has its default prompt (DEFAULT_TEMPLATES); `data.prompt_template` overrides it.

Why: the controller needs one uniform record (prompt text + reference answer + id) whatever the source; every
bad line must fail loudly with file, line number and what to fix, never be skipped silently.

Placeholders: `{name}` (a Python identifier) is replaced by the record's field; `{{` and `}}` are literal braces;
any other brace text stays as is, so "\\boxed{}" needs no escaping. Run the tests: `pytest tests/unit/data`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.data.sources import DataFormatError, read_jsonl, read_source  # noqa: F401  (read_jsonl: re-exported)
from areal_mq.grading import canonical_number, find_boxes, format_number

# The prompt the built-in and GSM8K tasks use. Short on purpose: every prompt token costs decode time on CPU.
# Chosen over "Put your final answer in \boxed{}." (never boxed, 25% lenient on a 16-problem probe) and two
# other wordings: with an explicit "\boxed{N}" the base model boxes sometimes and answers more often right.
DEFAULT_MATH_TEMPLATE = "{question}\nEnd your answer with \\boxed{{N}}, where N is the number."
# MATH answers are expressions (\frac{1}{2}, \sqrt{3}, intervals): no "where N is the number".
MATH_TEMPLATE = "{problem}\nPut your final answer within \\boxed{{}}."
# The default prompt of each layout; jsonl has none (its fields are the user's: data.prompt_template).
DEFAULT_TEMPLATES = {"arith": DEFAULT_MATH_TEMPLATE, "gsm8k": DEFAULT_MATH_TEMPLATE, "math": MATH_TEMPLATE}

_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_LEVEL = re.compile(r"^\s*(?:level\s*)?(\d+|\?)\s*$", re.IGNORECASE)  # "Level 5", "5", "Level ?"
# a few MATH solutions box without braces ("\boxed 5"): the token after the space, up to "$" or a space
_SPACED_BOX = re.compile(r"\\boxed ([^\s$]+)")


@dataclass(frozen=True)
class Problem:
    """One prompt of a dataset.

    id        unique within the dataset (from the record's id field, else "<file stem>-<line>")
    prompt    the user message (template applied; the chat template is applied later, see prompts.py)
    answer    reference answer as a canonical number string ("1234", "-2.5") or, for non-numeric
              references, the raw string
    level     difficulty level where the source has one (arith, MATH "Level N", a jsonl level_field), else None
    meta      the rest of the record (e.g. the worked solution; MATH: "subject", "solution"), for logging,
              reward functions and evaluation's by_subject; "source" names the source in a mix
    """

    id: str
    prompt: str
    answer: str
    level: int | None = None
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def template_fields(template: str) -> list[str]:
    """Placeholder names used by `template`, in order of first use."""
    names: list[str] = []
    for m in _PLACEHOLDER.finditer(template):
        if m.group(1) and m.group(1) not in names:
            names.append(m.group(1))
    return names


def fill_template(template: str, record: dict[str, Any]) -> str:
    """Replace `{field}` by str(record[field]); `{{`/`}}` become literal braces. KeyError on a missing field."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "{{":
            return "{"
        if m.group(0) == "}}":
            return "}"
        return str(record[m.group(1)])

    return _PLACEHOLDER.sub(sub, template)


def normalize_answer(value: Any, where: str) -> str:
    """Reference answer as a canonical number string when it is numeric, else the stripped string."""
    if isinstance(value, bool) or value is None or isinstance(value, (list, dict)):
        raise DataFormatError(f"{where}: answer must be a number or a string, got {value!r}")
    if isinstance(value, (int, float)):
        return format_number(value) if isinstance(value, int) else canonical_number(repr(value)) or str(value)
    text = str(value).strip()
    if not text:
        raise DataFormatError(f"{where}: answer is empty")
    return canonical_number(text) or text


def parse_level(value: Any, where: str, level_field: str = "level") -> int | None:
    """A record's level: an int stays, "Level 5" / "5" -> 5, "Level ?" / "?" / None -> None."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    m = _LEVEL.match(value) if isinstance(value, str) else None
    if m is None:
        raise DataFormatError(f"{where}: {level_field!r} must be an integer or 'Level N', got {value!r}; fix the "
                              "record, or set data.level_field to the field that holds levels (null: no levels)")
    return None if m.group(1) == "?" else int(m.group(1))


def _require(obj: dict, name: str, where: str, hint: str) -> Any:
    if name not in obj:
        raise DataFormatError(f"{where}: missing field {name!r} (has {sorted(obj)}); {hint}")
    return obj[name]


def _problem_id(obj: dict, id_field: str | None, source: str | Path, key: int) -> str:
    if id_field and id_field in obj:
        return str(obj[id_field])
    return f"{_stem(source)}-{key}"


def _stem(source: str | Path) -> str:
    path = Path(str(source))
    if not path.exists() and ":" in str(source):  # DIR:split of a saved DatasetDict
        head, _, split = str(source).rpartition(":")
        return f"{Path(head).stem}-{split}"
    return path.stem


def load_gsm8k(path: str | Path, template: str = DEFAULT_MATH_TEMPLATE, id_field: str | None = "id") -> list[Problem]:
    """GSM8K layout: `question` + `answer` whose last line is "#### N"; the part before is kept as meta."""
    problems = []
    for key, where, obj in read_source(path):
        hint = "GSM8K records need 'question' and 'answer' ending in '#### N'"
        question = _require(obj, "question", where, hint)
        solution = str(_require(obj, "answer", where, hint))
        m = _GSM8K_FINAL.search(solution)
        if m is None:
            raise DataFormatError(f"{where}: answer has no final '#### N' line; {hint}")
        answer = normalize_answer(m.group(1), where)
        prompt = fill_template(template, {**obj, "question": question})
        meta = {"solution": solution[: m.start()].strip()}
        problems.append(Problem(_problem_id(obj, id_field, path, key), prompt, answer, None, meta))
    return _checked(problems, path)


def load_records(
    path: str | Path,
    template: str,
    answer_field: str = "answer",
    id_field: str | None = "id",
    level_field: str | None = "level",
) -> list[Problem]:
    """Generic JSONL: prompt = `template` filled from the record, answer = record[answer_field]."""
    needed = template_fields(template)
    problems = []
    for key, where, obj in read_source(path):
        for name in [*needed, answer_field]:
            _require(obj, name, where, f"the prompt template uses {needed} and the answer field is {answer_field!r}")
        answer = normalize_answer(obj[answer_field], where)
        level = parse_level(obj.get(level_field), where, level_field) if level_field else None
        meta = {k: v for k, v in obj.items() if k not in (answer_field, id_field)}
        prompt = fill_template(template, obj)
        problems.append(Problem(_problem_id(obj, id_field, path, key), prompt, answer, level, meta))
    return _checked(problems, path)


def load_math(
    path: str | Path,
    template: str = MATH_TEMPLATE,
    answer_field: str = "answer",
    id_field: str | None = "id",
    level_field: str | None = "level",
) -> list[Problem]:
    """MATH / MATH-500 layout: `problem`, answer = record[answer_field] if present, else the solution's last box."""
    hint = "MATH records need 'problem' and a 'solution' with \\boxed{answer} (or an 'answer' field)"
    problems = []
    for key, where, obj in read_source(path):
        prompt = fill_template(template, {**obj, "problem": _require(obj, "problem", where, hint)})
        if answer_field in obj:
            answer = normalize_answer(obj[answer_field], where)
        else:
            answer = normalize_answer(math_solution_answer(str(_require(obj, "solution", where, hint)), where), where)
        level = parse_level(obj.get(level_field), where, level_field) if level_field else None
        meta = {"subject": obj.get("subject", obj.get("type")), "solution": obj.get("solution")}
        id_key = id_field if id_field and id_field in obj else "unique_id"  # MATH-500: "test/algebra/1.json"
        problems.append(Problem(_problem_id(obj, id_key, path, key), prompt, answer, level,
                                {k: v for k, v in meta.items() if v is not None}))
    return _checked(problems, path)


def math_solution_answer(solution: str, where: str) -> str:
    r"""The content of the last `\boxed{...}` / `\fbox{...}` of a MATH solution (grading.find_boxes)."""
    boxes = find_boxes(solution)
    if boxes.unclosed:
        raise DataFormatError(f"{where}: the solution has a \\boxed{{ whose braces never close; fix the record's "
                              "braces or give the answer in an 'answer' field")
    if boxes.contents:
        return boxes.contents[-1]
    spaced = _SPACED_BOX.findall(solution)
    if spaced:
        return spaced[-1]
    raise DataFormatError(f"{where}: the solution has no \\boxed{{...}} answer; MATH solutions end with "
                          "\\boxed{answer} (add one, or give the answer in an 'answer' field)")


def _checked(problems: list[Problem], path: str | Path) -> list[Problem]:
    if not problems:
        raise DataFormatError(f"dataset file {path} has no records; it needs at least one record")
    seen: dict[str, int] = {}
    for i, p in enumerate(problems):
        if p.id in seen:
            raise DataFormatError(f"{path}: duplicate id {p.id!r} (records {seen[p.id] + 1} and {i + 1}); ids must be unique")
        seen[p.id] = i
    return problems


def sniff_format(path: str | Path) -> str:
    """From the first record: 'gsm8k' (`question` + an `answer` containing '####'), 'math' (`problem` +
    `solution`), else 'jsonl'."""
    for _, _, obj in read_source(path):
        if "question" in obj and "####" in str(obj.get("answer", "")):
            return "gsm8k"
        if "problem" in obj and "solution" in obj:
            return "math"
        return "jsonl"
    raise DataFormatError(f"dataset file {path} has no records; it needs at least one record")
