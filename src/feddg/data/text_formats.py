"""Readers of the text layouts: Blitzer et al.'s multi-domain sentiment release (raw and ``processed_acl``) and
CSV / JSONL tables.

Each reader returns per-domain samples and the list of every problem found, one line each as
``path:line: what is wrong``; ``data.base.first_problem`` turns that list into the one-line error a load stops with.

Layouts (Blitzer, Dredze & Pereira, ACL 2007, "Biographies, Bollywood, Boom-boxes and Blenders"):

- raw: ``root/<domain>/{positive,negative}.review``, pseudo-XML with one ``<review>`` per entry whose
  ``<review_text>`` is the text (HTML entities unescaped; ``unlabeled.review`` is ignored);
- ``processed_acl``: the same files, one review per line ``tok:count tok_tok:count ... #label#:positive``;
- table: a ``.csv`` / ``.jsonl`` file, or a folder of them, with columns (keys) ``text``, ``label``, ``domain``.
"""

from __future__ import annotations

import csv
import html
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path

from feddg.data.base import ascii_int, surplus_fields

#: Amazon Reviews' domains as feddg names them, and the folder names the release may use for each
AMAZON_DOMAINS = ("books", "dvd", "electronics", "kitchen")
AMAZON_FOLDERS = {"kitchen": ("kitchen", "kitchen_&_housewares")}
SENTIMENT = ("negative", "positive")  # class 0, class 1
RAW_LAYOUT = "root/<domain>/{positive,negative}.review (Blitzer et al.'s release; domains books, dvd, electronics, kitchen)"
ACL_LAYOUT = "root/<domain>/{positive,negative}.review with lines `tok:count ... #label#:positive|negative`"
TABLE_LAYOUT = "a .csv or .jsonl file (or a folder of them) with columns text, label, domain"
TABLE_COLUMNS = ("text", "label", "domain")
TABLE_SUFFIXES = (".csv", ".jsonl")  # compared lower-cased
_TAG = re.compile(r"<(/?)(review|review_text)>")

Labelled = list[tuple[str, int]]  # (text, class index) per review
Counts = list[tuple[dict[str, int], int]]  # (feature counts, class index) per review


def _read_text(path: Path) -> str:
    """The file as text: UTF-8, line by line Latin-1 where a line is not UTF-8 (the 2007 release mixes encodings;
    decoding a whole file as Latin-1 for one odd byte turned every UTF-8 character of it into two)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "\n".join(_line_text(line) for line in data.split(b"\n"))


def _line_text(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return line.decode("latin-1")


def domain_folder(root: Path, domain: str) -> Path | None:
    """The folder of an Amazon domain under ``root`` (``kitchen`` may be named ``kitchen_&_housewares``)."""
    for name in AMAZON_FOLDERS.get(domain, (domain,)):
        if (root / name).is_dir():
            return root / name
    return None


def review_files(root: str | Path, domains: tuple[str, ...] = AMAZON_DOMAINS) -> tuple[list[tuple[str, Path, int]], list[str]]:
    """``(domain, file, class)`` of every ``{negative,positive}.review`` of ``domains`` under ``root``, and the
    problems of the layout (a missing root, domain folder or file)."""
    path = Path(root).expanduser()
    if not path.is_dir():
        return [], [f"{path}: no such folder; expected {RAW_LAYOUT}"]
    files, problems = [], []
    for domain in domains:
        folder = domain_folder(path, domain)
        if folder is None:
            problems.append(f"{path / domain}: domain folder is missing")
            continue
        for k, polarity in enumerate(SENTIMENT):
            file = folder / f"{polarity}.review"
            if file.is_file():
                files.append((domain, file, k))
            else:
                problems.append(f"{file}: file is missing")
    return files, problems


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def parse_raw_reviews(path: Path) -> tuple[list[str], list[str]]:
    """The ``<review_text>`` of every ``<review>`` of a raw ``.review`` file (entities unescaped, whitespace
    collapsed), and its problems. Not valid XML (bare ``&``, ``<`` in texts), so tags are matched by a regex."""
    text = _read_text(path)
    texts: list[str] = []
    problems: list[str] = []
    review_at = body_at = None  # offsets of the open <review> and of the end of the open <review_text>
    body: str | None = None
    for m in _TAG.finditer(text):
        closing, tag, pos = m.group(1) == "/", m.group(2), m.start()
        if tag == "review" and not closing:
            if review_at is not None:
                problems.append(f"{path}:{_line(text, review_at)}: <review> is not closed before the next <review>")
            review_at, body_at, body = pos, None, None
        elif tag == "review":
            if review_at is None:
                problems.append(f"{path}:{_line(text, pos)}: </review> without <review>")
            elif body_at is not None:
                problems.append(f"{path}:{_line(text, body_at)}: <review_text> is not closed")
            elif body is None:
                problems.append(f"{path}:{_line(text, review_at)}: review has no <review_text>")
            elif not body:
                problems.append(f"{path}:{_line(text, review_at)}: review has an empty <review_text>")
            else:
                texts.append(body)
            review_at, body_at, body = None, None, None
        elif not closing:
            if review_at is None:
                problems.append(f"{path}:{_line(text, pos)}: <review_text> outside a <review>")
            elif body_at is not None or body is not None:
                problems.append(f"{path}:{_line(text, pos)}: a second <review_text> in one <review>")
            body_at = m.end()
        elif body_at is None:
            problems.append(f"{path}:{_line(text, pos)}: </review_text> without <review_text>")
        else:
            body, body_at = " ".join(html.unescape(text[body_at:pos]).split()), None
    if review_at is not None:
        problems.append(f"{path}:{_line(text, review_at)}: <review> is not closed")
    if not texts and not problems:  # an empty file, or another layout's (processed_acl's lines)
        problems.append(f"{path}: no <review> entries; expected {RAW_LAYOUT}")
    return texts, problems


def read_raw(root: str | Path, domains: tuple[str, ...] = AMAZON_DOMAINS) -> tuple[dict[str, Labelled], list[str]]:
    """Blitzer et al.'s raw release: ``(text, class)`` per review of each domain (classes :data:`SENTIMENT`)."""
    files, problems = review_files(root, domains)
    out: dict[str, Labelled] = {d: [] for d in domains}
    for domain, file, k in files:
        texts, bad = parse_raw_reviews(file)
        out[domain] += [(t, k) for t in texts]
        problems += bad
    return out, problems


def parse_acl_line(path: Path, number: int, line: str) -> tuple[dict[str, int], str] | str:
    """``(feature counts, label name)`` of a ``processed_acl`` line, or the problem with it. Tokens are split at
    spaces only (a Latin-1 file's U+00A0 or U+0085 is part of a token, not a separator)."""
    *pairs, last = [t for t in line.split(" ") if t]
    if not last.startswith("#label#:"):
        return f"{path}:{number}: the line does not end with #label#:positive or #label#:negative"
    label = last.removeprefix("#label#:")
    if label not in SENTIMENT:
        return f"{path}:{number}: unknown label {label!r}; expected positive or negative"
    counts: dict[str, int] = {}
    for pair in pairs:
        feature, _, count = pair.rpartition(":")
        n = ascii_int(count)
        if not feature or n is None or n < 1:
            return f"{path}:{number}: {pair!r} is not feature:count with a positive count"
        counts[feature] = counts.get(feature, 0) + n
    return counts, label


def read_processed_acl(root: str | Path, domains: tuple[str, ...] = AMAZON_DOMAINS) -> tuple[dict[str, Counts], list[str]]:
    """``processed_acl``: ``(feature counts, class)`` per review of each domain; a file's label must match each
    line's ``#label#``."""
    files, problems = review_files(root, domains)
    out: dict[str, Counts] = {d: [] for d in domains}
    for domain, file, k in files:
        before = len(out[domain])
        for number, line in enumerate(_read_text(file).split("\n"), 1):  # not splitlines: U+0085 is a line break there
            line = line.removesuffix("\r")
            if not line.strip(" "):
                continue
            parsed = parse_acl_line(file, number, line)
            if isinstance(parsed, str):
                problems.append(parsed)
            elif parsed[1] != SENTIMENT[k]:
                problems.append(f"{file}:{number}: label {parsed[1]} in the {SENTIMENT[k]} file")
            else:
                out[domain].append((parsed[0], k))
        if len(out[domain]) == before and not any(p.startswith(f"{file}:") for p in problems):
            problems.append(f"{file}: no review lines; expected {ACL_LAYOUT}")
    return out, problems


def _is_table(path: Path) -> bool:
    """A visible ``.csv`` / ``.jsonl`` file, any case (hidden files, e.g. macOS ``._a.csv``, are not tables)."""
    return path.is_file() and not path.name.startswith(".") and path.suffix.lower() in TABLE_SUFFIXES


def table_files(root: str | Path) -> tuple[list[Path], list[str]]:
    """The ``.csv`` / ``.jsonl`` files of ``root`` (a file, or a folder's, sorted), and the layout's problems."""
    path = Path(root).expanduser()
    if path.is_file():
        files = [path] if path.suffix.lower() in TABLE_SUFFIXES else []
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if _is_table(p))
    else:
        return [], [f"{path}: no such file or folder; expected {TABLE_LAYOUT}"]
    if not files:
        return [], [f"{path}: no .csv or .jsonl file; expected {TABLE_LAYOUT}"]
    return files, []


def _csv_rows(text: str) -> Iterator[tuple[int, dict[str, object] | str]]:
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in TABLE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        yield 1, f"the header lacks column(s) {', '.join(missing)}; expected {', '.join(TABLE_COLUMNS)}"
        return
    for row in reader:
        yield reader.line_num, surplus_fields(row, reader.fieldnames) or dict(row)


def _jsonl_rows(text: str) -> Iterator[tuple[int, dict[str, object] | str]]:
    for number, line in enumerate(io.StringIO(text, newline=None), 1):  # lines end at \n, \r\n or \r
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            yield number, f"not JSON ({err.msg})"
            continue
        yield number, row if isinstance(row, dict) else "not a JSON object"


def _rows(path: Path) -> Iterator[tuple[int, dict[str, object] | str]]:
    """``(line, row)`` of a UTF-8 table file (a leading BOM, as Excel writes, is dropped), or ``(line, problem)``
    for a row that cannot be read."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # not utf-8-sig: err.start stays the file's offset
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        yield line, f"not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})"
        return
    yield from _csv_rows(text) if path.suffix.lower() == ".csv" else _jsonl_rows(text)


def _class_names(labels: set[str]) -> dict[str, str]:
    """Each label's class name: 0/1 are negative/positive when every label is 0, 1, negative or positive (binary
    sentiment); otherwise every label keeps its own name (star ratings 1-5 stay ``1`` ... ``5``)."""
    binary = dict(zip(("0", "1"), SENTIMENT, strict=True))
    if labels <= {*binary, *SENTIMENT}:
        return {label: binary.get(label, label) for label in labels}
    return {label: label for label in labels}


def _field(row: dict[str, object], column: str) -> str | None:
    """A cell as text: a string, or an integer label or domain (JSON's ``1``); ``None`` for any other value (a float,
    a boolean, a list, an object: ``1`` and ``1.0`` must not become two classes)."""
    value = row.get(column)
    if isinstance(value, str):
        return value.strip()
    if column != "text" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def read_table(root: str | Path) -> tuple[list[str], dict[str, list[tuple[str, str]]], list[str]]:
    """CSV / JSONL rows: the sorted domain names, ``(text, label name)`` per row of each, and the problems."""
    files, problems = table_files(root)
    out: dict[str, list[tuple[str, str]]] = {}
    for file in files:
        rows = 0
        for number, row in _rows(file):
            rows += 1
            if isinstance(row, str):
                problems.append(f"{file}:{number}: {row}")
                continue
            missing = [c for c in TABLE_COLUMNS if row.get(c) is None]
            wrong = [c for c in TABLE_COLUMNS if c not in missing and _field(row, c) is None]
            text, label, domain = (_field(row, c) or "" for c in TABLE_COLUMNS)
            if missing or wrong or not (text and label and domain):
                what = (f"lacks {', '.join(missing)}" if missing else
                        f"has {', '.join(f'{c} {row[c]!r}' for c in wrong)}: text must be a string, label and domain "
                        "strings or integers" if wrong else "has an empty text, label or domain")
                problems.append(f"{file}:{number}: the row {what}")
                continue
            out.setdefault(domain, []).append((" ".join(text.split()), label))
        if rows == 0:
            problems.append(f"{file}: no rows; expected {TABLE_LAYOUT}")
    names = _class_names({label for samples in out.values() for _, label in samples})
    return sorted(out), {d: [(t, names[label]) for t, label in out[d]] for d in sorted(out)}, problems
