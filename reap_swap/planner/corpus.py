"""The observation corpus: one JSON record per line (chat messages, prompt or text, a tag), parsed
and tokenized with every problem reported by line number before any engine runs. Pure: the
tokenizer is passed in."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_LISTED_ISSUES = 1000


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[Any] | None = None


class _ChatRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    messages: list[_Message] = Field(min_length=1)


class _TextRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str = Field(min_length=1)


class _PromptRecord(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: str = Field(min_length=1)


@dataclass(frozen=True)
class CorpusRecord:
    line: int  # 1-based line number in the corpus file
    tag: str | None
    messages: list[dict] | None  # chat records
    text: str | None  # prompt / text records


@dataclass(frozen=True)
class CorpusIssue:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def _tag(obj: Mapping) -> str | None:
    for name in ("tag", "source"):
        value = obj.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def parse_line(line_no: int, raw: bytes) -> CorpusRecord | CorpusIssue | None:
    """One corpus line -> a record, an issue, or None for a blank line."""
    if not raw.strip():
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return CorpusIssue(line_no, f"not valid JSON ({exc})")
    if not isinstance(obj, dict):
        return CorpusIssue(line_no, f"a record is a JSON object, not {type(obj).__name__}")
    tag = _tag(obj)
    try:
        if "messages" in obj:
            chat = _ChatRecord.model_validate(obj)
            return CorpusRecord(line_no, tag, [m.model_dump(exclude_none=True) for m in chat.messages], None)
        if "prompt" in obj:
            return CorpusRecord(line_no, tag, None, _PromptRecord.model_validate(obj).prompt)
        if "text" in obj:
            return CorpusRecord(line_no, tag, None, _TextRecord.model_validate(obj).text)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return CorpusIssue(line_no, f"{where}: {first['msg']}")
    return CorpusIssue(line_no, f"no 'messages', 'prompt' or 'text' field (keys: {sorted(obj)[:8]})")


def read_corpus(path: str | os.PathLike) -> tuple[list[CorpusRecord], list[CorpusIssue]]:
    records, issues = [], []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            item = parse_line(n, raw)
            if isinstance(item, CorpusRecord):
                records.append(item)
            elif isinstance(item, CorpusIssue):
                issues.append(item)
    return records, issues


def tokenize_records(
    tokenizer, records: Sequence[CorpusRecord], max_len: int
) -> tuple[list[tuple[CorpusRecord, list[int]]], list[CorpusIssue]]:
    """Token ids per record: chat -> the model's chat template (no generation prompt: the corpus
    is what is observed); text -> the tokenizer's own special tokens, as vLLM would add them."""
    out, issues = [], []
    for rec in records:
        try:
            if rec.messages is not None:
                text = tokenizer.apply_chat_template(
                    rec.messages, tokenize=False, add_generation_prompt=False
                )
                ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            else:
                ids = list(tokenizer(rec.text)["input_ids"])
        except Exception as exc:  # templates raise anything from jinja2 errors to ValueError
            issues.append(CorpusIssue(rec.line, f"cannot tokenize: {type(exc).__name__}: {exc}"))
            continue
        if not ids:
            issues.append(CorpusIssue(rec.line, "no tokens"))
        elif len(ids) > max_len:
            issues.append(
                CorpusIssue(rec.line, f"{len(ids)} tokens, over the model's max_model_len {max_len}")
            )
        else:
            out.append((rec, ids))
    return out, issues
