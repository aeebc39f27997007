"""The documents hold: links resolve, quoted commands parse, no work history, README is short.

- every relative link in README.md, the other top-level documents, docs/ and envoy/README.md
  names a file or directory of the repository;
- every `extproc …` command line quoted in them (shell blocks and inline code) is accepted by
  the current command line: the verb exists and its parser takes the flags (a token written as
  `a|b|c` is tried with each alternative);
- no document carries work history: no session or issue numbers, no commit hashes, no dates of
  work, no talk of who did what;
- README.md stays a short entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

from extproc.cli import VERBS

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    {*REPO.glob("*.md"), *(REPO / "docs").rglob("*.md"), REPO / "envoy" / "README.md"}
)
IDS = [str(p.relative_to(REPO)) for p in DOCUMENTS]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(extproc [^`]+)`")
FOR_LOOP = re.compile(r"\bfor (\w+) in (\S+)")
HISTORY = {
    "a session number": re.compile(r"\bsession \d+\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.IGNORECASE),
    "this session": re.compile(r"\b(this|last|previous|earlier|next) session\b", re.IGNORECASE),
    "who did what": re.compile(r"\b(helpers?|the lead)\b", re.IGNORECASE),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "a date": re.compile(
        r"\b20\d\d-[01]\d-[0-3]\d\b(?<!2023-06-01)"
        r"|\b(January|February|March|April|June|July|August|September|October|November"
        r"|December|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\.? \d{1,2}\b"
    ),
    "a superseded figure": re.compile(r"\b(superseded|no longer current|rerun on this code)\b"),
}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", DOCUMENTS, ids=IDS)
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in LINK.findall(_text(doc)):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert broken == []


def _command_lines(text: str) -> list[tuple[str, bool]]:
    """Every `extproc …` line: (line, whole) where whole is a shell-block command to parse as
    written, and not whole a mention in prose (inline code) whose verb and flags must exist."""
    found = [(m.group(1), False) for m in INLINE.finditer(CODE_BLOCK.sub("", text))]
    for lang, block in CODE_BLOCK.findall(text):
        if lang not in ("sh", "bash", "shell", "console"):
            continue
        loops: dict[str, str] = {}  # `for X in a b c; do`: $X stands for its first value
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            for var, first in FOR_LOOP.findall(line):
                loops[var] = first
            for var, value in loops.items():
                line = line.replace(f"${{{var}}}", value).replace(f"${var}", value)
            line = line.split("for ")[0] if line.startswith("for ") else line
            if line.startswith("extproc "):
                found.append((line, True))
    return found


def _cut(line: str) -> list[str]:
    """The command's own words: up to a pipe, redirection, comment or `&`."""
    words = []
    for word in shlex.split(line, comments=True):
        if word in ("|", ">", ">>", "&", "&&", ";") or word.startswith(">"):
            break
        words.append(word.removesuffix("&"))
    return words


def _variants(words: list[str]) -> list[list[str]]:
    """``a|b|c`` written in prose: each alternative in turn, the other words as written."""
    for i, word in enumerate(words):
        if "|" in word:
            return [
                v for alt in word.split("|") for v in _variants([*words[:i], alt, *words[i + 1 :]])
            ]
    return [words]


def _parser(verb: str) -> argparse.ArgumentParser:
    module = importlib.import_module(VERBS[verb][0])
    parser = argparse.ArgumentParser(prog=f"extproc {verb}", exit_on_error=False)
    module.add_arguments(parser)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _mention_error(words: list[str]) -> str | None:
    """A command named in prose: its verb (and sub-verb) exist and it has every flag named."""
    parser = _parser(words[1])
    rest = words[2:]
    subs = _subparsers(parser)
    if subs and rest and not rest[0].startswith("-"):
        if rest[0] not in subs:
            return f"no {rest[0]!r} under {words[1]}"
        parser, rest = subs[rest[0]], rest[1:]
    known = {opt for action in parser._actions for opt in action.option_strings}
    unknown = [w for w in rest if w.startswith("-") and w != "-" and w.split("=")[0] not in known]
    return f"unknown flags {unknown}" if unknown else None


def _parse_error(words: list[str]) -> str | None:
    parser = _parser(words[1])
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(words[2:])
    except (SystemExit, argparse.ArgumentError) as exc:
        return f"{exc} {err.getvalue().strip().splitlines()[-1:]}"
    return None


QUOTED = [
    (str(doc.relative_to(REPO)), line, whole)
    for doc in DOCUMENTS
    for line, whole in _command_lines(_text(doc))
]


def test_the_documents_quote_commands() -> None:
    assert len(QUOTED) > 40
    assert sum(whole for _, _, whole in QUOTED) > 10


@pytest.mark.parametrize(
    ("where", "line", "whole"), QUOTED, ids=[f"{w}:{ln[:60]}" for w, ln, _ in QUOTED]
)
def test_every_quoted_command_parses(where: str, line: str, whole: bool) -> None:
    words = _cut(line)
    if words[-1:] == ["--help"]:
        words = words[:-1]
    assert words[1] in VERBS, f"{where}: unknown verb in {line}"
    check = _parse_error if whole else _mention_error
    problems = [e for v in _variants(words) if (e := check(v))]
    assert problems == [], f"{where}: {line}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=IDS)
def test_no_document_carries_work_history(doc: Path) -> None:
    text = _text(doc)
    found = [
        f"{what}: {m.group(0)!r} (line {text.count(chr(10), 0, m.start()) + 1})"
        for what, pattern in HISTORY.items()
        for m in pattern.finditer(text)
    ]
    assert found == []


def test_the_readme_is_a_short_entry_point() -> None:
    assert len(_text(REPO / "README.md").splitlines()) <= 300
