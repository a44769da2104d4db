"""Incremental readers for JSON arrays and JSON lines, in memory bounded by one record plus a few read chunks.

Both read a :class:`TextWindow`: the decoded text of a file, kept only from the record (or line) being parsed to
the end of what was read so far, refilled chunk by chunk. The window keeps running counts (characters and
newlines dropped, position of the last dropped newline) so that every position in a message or in the
truncation info (char offset, 1-based line and column, as the json module counts them) is the same as a parse
of the whole text would give, whatever the chunk size.

A JSON array is parsed element by element with ``json.JSONDecoder.raw_decode``. A decision is taken only when
more text could not change it: a value that may continue (a number or literal reaching the window end), an
unterminated string, or a decode error near the window end read more first; only at the real end of the
file is such a case a cut-off record.

The readers yield ``(row_id, row, None)`` for a row and ``(row_id, None, RowError)`` for a line that is not JSON,
and put what they noticed (a cut-off file, a stop at ``max_samples``) into a :class:`ReadState`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtune.config.schema import DatasetConfig
from llmtune.data.errors import DataError, RowError

_WS = re.compile(r"[ \t\n\r]*")
# What may be left of a JSON value cut off at end of file: a literal or number prefix.
_PARTIAL_TAIL = re.compile(r"(t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|[-+.eE0-9]*)\s*\Z")
# A decode error this close to the window end may be caused by the window ending (e.g. "-Infin" of
# "-Infinity", a "\u12" escape), and a value ending this close to it may continue ("23" -> "23.5"): read more
# text before deciding. The json module looks at most 9 characters ("-Infinity") past a position to decide.
_NEAR_END = 32

Event = tuple[int, Any, RowError | None]


@dataclass
class ReadState:
    """What a reader noticed besides rows (set when the reader ends)."""

    truncated_json: dict | None = None
    stopped_early: bool = False


class TextWindow:
    """The decoded text of a file, held from a kept position to the end of what was read.

    Attributes:
        buf: the text held; ``buf[0]`` is character ``base`` of the file's text.
        base: global character offset of ``buf[0]``.
        eof: all text has been read (``buf`` reaches the end of the file's text).
    """

    def __init__(self, chunks: Iterator[str]):
        self._chunks = chunks
        self.buf = ""
        self.base = 0
        self.eof = False
        self._newlines = 0  # "\n" characters before base
        self._last_newline = -1  # global offset of the last "\n" before base (-1: none)
        self._error: DataError | None = None  # raised by the chunk source, held until the text before it is used

    @property
    def end(self) -> int:
        """Global character offset of the end of the text read so far."""
        return self.base + len(self.buf)

    def fill(self, keep: int, want: int = 1) -> bool:
        """Drop the text before global offset ``keep`` and read at least ``want`` more characters (or to the end).

        Returns:
            True when text was added; False at the end of the file (then ``eof`` is True).

        Raises:
            DataError: from the chunk source (invalid UTF-8, a damaged gzip stream), raised only once all the
                text before the problem has been handed out.
        """
        k = keep - self.base
        if k > 0:
            self._newlines += self.buf.count("\n", 0, k)
            r = self.buf.rfind("\n", 0, k)
            if r >= 0:
                self._last_newline = self.base + r
            self.buf = self.buf[k:]
            self.base = keep
        if self._error is not None:
            raise self._error
        if self.eof:
            return False
        got: list[str] = []
        n = 0
        try:
            for chunk in self._chunks:
                got.append(chunk)
                n += len(chunk)
                if n >= want:
                    break
            else:
                self.eof = True
        except DataError as exc:
            if not got:
                raise
            self._error = exc
        if got:
            self.buf += "".join(got)
        return n > 0

    def line_col(self, pos: int) -> tuple[int, int]:
        """1-based line and column of global character offset ``pos >= base`` (as the json module counts them)."""
        k = pos - self.base
        line = self._newlines + self.buf.count("\n", 0, k) + 1
        r = self.buf.rfind("\n", 0, k)
        return line, pos - (self.base + r if r >= 0 else self._last_newline)


def is_cut(text: str, exc: json.JSONDecodeError) -> bool:
    """True when a decode error is explained by the text ending, not by a syntax error."""
    if exc.msg.startswith("Unterminated string"):
        return True
    if exc.msg.startswith("Invalid \\uXXXX escape") and len(text) - exc.pos <= 6:
        return True
    return _PARTIAL_TAIL.match(text, exc.pos) is not None


def _cut_info(w: TextWindow, path: Path, record: tuple[int, int, int] | None, kept: int,
              json_error: str | None) -> dict:
    """Where the text ends (``w`` at end of file) and where the cut-off record ``(char, line, column)`` starts."""
    line, col = w.line_col(w.end)
    info = {"records_kept": kept, "cut_at_char": w.end, "cut_at_line": line, "cut_at_column": col,
            "file_bytes": path.stat().st_size}
    if record is not None:
        info.update(partial_record_char=record[0], partial_record_line=record[1], partial_record_column=record[2])
    if json_error is not None:
        info["json_error"] = json_error
    return info


def _truncated(state: ReadState, ds: DatasetConfig, key: str, path: Path, info: dict) -> None:
    if not ds.allow_truncated_json:
        where = (
            f" inside record {info['records_kept']} (which starts at line {info['partial_record_line']}, "
            f"column {info['partial_record_column']}, char {info['partial_record_char']})"
            if "partial_record_char" in info
            else ""
        )
        detail = f" ({info['json_error']})" if "json_error" in info else ""
        raise DataError(
            f"{path} is cut off mid-record: the JSON ends at char {info['cut_at_char']} (line {info['cut_at_line']}, "
            f"column {info['cut_at_column']}){where}{detail}; {info['records_kept']} complete records precede the cut. "
            f"To train on those, set {key}.allow_truncated_json: true (the cut is recorded in data_report.json); "
            "otherwise re-download or repair the file."
        )
    state.truncated_json = info


def first_char(w: TextWindow) -> tuple[int, int]:
    """Global offsets of the first non-whitespace character (``w.end`` if none) and of the start of its line."""
    i = line_start = 0
    while True:
        j = _WS.match(w.buf, i - w.base).end()
        r = w.buf.rfind("\n", i - w.base, j)
        if r >= 0:
            line_start = w.base + r + 1
        j += w.base
        if j < w.end or not w.fill(line_start):
            return j, line_start
        i = j


def _skip_ws(w: TextWindow, i: int) -> int:
    """Global offset of the first non-whitespace character at or after ``i`` (``w.end`` at end of file)."""
    while True:
        buf = w.buf
        k = _WS.match(buf, i - w.base).end()
        if k < len(buf) or not w.fill(w.base + k):
            return w.base + k
        i = w.base


def read_json_array(w: TextWindow, i: int, path: Path, ds: DatasetConfig, key: str, limit: float,
                    state: ReadState) -> Iterator[Event]:
    """Records of a JSON array whose ``[`` ends at global offset ``i``; row ids are record indices.

    Raises:
        DataError: a syntax error (with its line, column and char), or a cut-off array without
            ``allow_truncated_json``.
    """
    decode = json.JSONDecoder().raw_decode
    kept = 0
    while True:
        i = _skip_ws(w, i)
        if i - w.base >= len(w.buf):  # ended after '[' or ','
            return _truncated(state, ds, key, path, _cut_info(w, path, None, kept, None))
        if w.buf[i - w.base] == "]":
            break
        if kept >= limit:
            state.stopped_early = True
            return
        while True:
            try:
                obj, end = decode(w.buf, i - w.base)
            except json.JSONDecodeError as exc:
                if not w.eof and (is_cut(w.buf, exc) or len(w.buf) - exc.pos < _NEAR_END):
                    w.fill(i, max(1, w.end - i))  # more text (doubling the record's part) or the end of the file
                    continue
                pos = w.base + exc.pos
                line, col = w.line_col(pos)
                if is_cut(w.buf, exc):
                    record = (i, *w.line_col(i))
                    error = f"{exc.msg} (line {line}, column {col}, char {pos})"
                    return _truncated(state, ds, key, path, _cut_info(w, path, record, kept, error))
                raise DataError(
                    f"{path}: invalid JSON in record {kept} (starts at line {w.line_col(i)[0]}): {exc.msg} at "
                    f"line {line} column {col} (char {pos}). Fix the file at that position."
                ) from None
            if not w.eof and len(w.buf) - end < _NEAR_END:  # e.g. "23" or "23." that may continue as "23.5"
                w.fill(i, max(1, w.end - i))
                continue
            break
        yield kept, obj, None
        kept += 1
        buf = w.buf
        k = _WS.match(buf, end).end()
        i = w.base + k if k < len(buf) else _skip_ws(w, w.base + k)
        if i - w.base >= len(w.buf):  # complete record, then the file ends without ',' or ']'
            return _truncated(state, ds, key, path, _cut_info(w, path, None, kept, None))
        ch = w.buf[i - w.base]
        if ch == ",":
            i += 1
        elif ch != "]":
            line, col = w.line_col(i)
            raise DataError(
                f"{path}: invalid JSON after record {kept - 1}: expected ',' or ']' at line {line} column {col} "
                f"(char {i}), found {ch!r}. Fix the file at that position."
            )
    while w.fill(w.end):  # the rest of the file is not parsed, but it must still be UTF-8 (as a whole-file read checks)
        pass


def _nonblank_lines(w: TextWindow, pos: int, lineno: int) -> Iterator[tuple[int, str, int]]:
    """``(0-based line number, line without its newline, global offset of its start)`` of each non-blank line."""
    while True:
        scan = pos
        while True:
            k = w.buf.find("\n", scan - w.base)
            if k >= 0:
                break
            scan = w.end
            if not w.fill(pos, max(1, w.end - pos)):
                line = w.buf[pos - w.base:]
                if line.strip():
                    yield lineno, line, pos
                return
        line = w.buf[pos - w.base:k]
        if line.strip():
            yield lineno, line, pos
        pos = w.base + k + 1
        lineno += 1


def read_json_lines(w: TextWindow, pos: int, path: Path, ds: DatasetConfig, key: str, limit: float,
                    state: ReadState) -> Iterator[Event]:
    """Rows of a JSON-lines text from its line starting at global offset ``pos``; row ids are 0-based line numbers.

    Blank lines are skipped; a line that is not JSON is a bad row, except the last non-blank line when it is cut
    off (a truncation).

    Raises:
        DataError: line 1 is ``{`` or ``[`` alone (a pretty-printed document), a cut-off last line without
            ``allow_truncated_json``, or a ``.json`` file holding one object with lists of records.
    """
    lines = _nonblank_lines(w, pos, w.line_col(pos)[0] - 1)
    kept = bad = 0
    first = None
    cur = next(lines, None)
    while cur is not None:
        lineno, line, start = cur
        if kept + bad >= limit:
            state.stopped_early = True
            break
        nxt: tuple[int, str, int] | None | bool = False
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            nxt = next(lines, None)  # is this the last non-blank line?
            if lineno == 0 and nxt is not None and line.strip() in ("{", "["):
                raise DataError(
                    f"{path}: line 1 is {line.strip()!r} alone: this looks like one pretty-printed JSON document, "
                    "not JSON lines. Use a top-level array of records or one record per line."
                ) from None
            if nxt is None and is_cut(line, exc):
                error = f"{exc.msg} (line {lineno + 1}, column {exc.colno})"
                _truncated(state, ds, key, path, _cut_info(w, path, (start, lineno + 1, 1), kept, error))
                break
            reason = f"invalid JSON on line {lineno + 1}: {exc.msg} at column {exc.colno}"
            bad += 1
            yield lineno, None, RowError("invalid JSON", reason)
        else:
            if kept == 0:
                first = obj
            kept += 1
            yield lineno, obj, None
        cur = next(lines, None) if nxt is False else nxt
    if kept == 1 and isinstance(first, dict) and not bad and path.name.endswith(".json"):
        if any(isinstance(v, list) and v and isinstance(v[0], dict) for v in first.values()):
            keys = ", ".join(first)
            raise DataError(
                f"{path} holds one JSON object (keys: {keys}), not a list of records. Use a top-level array "
                "of records or JSON lines (one record per line)."
            )
