"""Errors of the data layer.

``DataError`` is raised for problems the user must fix before training (missing files, unreadable
or cut-off JSON without opt-in, schema mismatches, bad rows under ``bad_rows: error``). Its message
says what is wrong, where (file, row index, field, dotted recipe key) and how to fix it.

``RowError`` is internal: one row of one source cannot be used. It carries a short ``kind`` (used to
count drop reasons in the report) and a full ``reason`` (shown to the user with the row index).
"""

from __future__ import annotations

from llmtune.errors import LlmtuneError


class DataError(LlmtuneError, ValueError):
    """A data source or its rows cannot be used as configured; the message says where and how to fix it."""


class RowError(Exception):
    """One row cannot be used.

    Attributes:
        kind: short category for counting, e.g. ``"missing field 'output'"``, ``"roles out of order"``.
        reason: full message for this row, e.g. ``"roles out of order: two user turns in a row (turns 1 and 2)"``.
        bad: True for malformed data (subject to ``data.bad_rows``); False for policy drops such as
            ``truncation: drop`` (always counted, never an error).
    """

    def __init__(self, kind: str, reason: str | None = None, *, bad: bool = True):
        self.kind = kind
        self.reason = reason or kind
        self.bad = bad
        super().__init__(self.reason)

    def detached(self) -> RowError:
        """This error without its traceback and context, to be kept (e.g. in a list of bad rows): a caught error's
        traceback holds the frames that raised it, and with them the batch of rows being converted, in a reference
        cycle that only the cyclic garbage collector frees — so every batch would stay in memory until it runs."""
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self
