"""The data report: what was read, kept, dropped (with reasons and row indices) and truncated.

Written to ``runs/<name>/data_report.json`` and summarised on the console. Row indices are 0-based
indices in the source file (JSON lines: the 0-based line number), so a reason can be checked in the
file directly.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmtune.utils import content_sha256


@dataclass
class SourceReport:
    """Counts for one source (rows are samples, not tokens).

    Attributes:
        path: as written in the recipe. location: what was read (file, directory, hub id).
        format: the format used (detected when ``format: auto``).
        rows_read: records read (up to ``max_samples``), including unparseable ones.
        rows_valid: rows that passed the format checks.
        rows_kept: distinct rows in the train or eval set.
        train_rows: rows in the train set, counting repeats from ``weight`` > 1. eval_rows: rows in eval.
        weight: the mixing weight. stopped_early: reading stopped at ``max_samples``.
        truncated_json: for a JSON file cut off mid-record: records kept and where the cut is.
        tool_rows: valid rows that are tool conversations (tool calls, tool results or a ``tools`` column).
        skipped_rows: rows skipped at the start of the file (``skip_rows``), not read.
    """

    path: str
    location: str
    format: str
    rows_read: int
    rows_valid: int = 0
    rows_kept: int = 0
    train_rows: int = 0
    eval_rows: int = 0
    weight: float = 1.0
    stopped_early: bool = False
    truncated_json: dict | None = None
    tool_rows: int = 0
    skipped_rows: int = 0


@dataclass
class DataReport:
    """What the data pipeline did.

    Attributes:
        sources: one :class:`SourceReport` per ``data.datasets`` entry.
        dropped: ``{source, row, kind, reason}`` per dropped row (bad rows under ``bad_rows: skip``, rows
            too long under ``truncation: drop``, rows with no trained tokens left after truncation).
        truncated_rows: ``{source, row, prompt_tokens_cut, response_tokens_cut}`` per kept row that was cut
            (tokens removed from its prompt/context and from its response/completions; PPO prompts have no
            response count).
        train_rows / eval_rows: rows (samples) in the splits; train_sequences / eval_sequences: sequences
            after packing (equal to the rows when not packing).
        tokens / trained_tokens: tokens in the train split, and those with a label != -100.
        eval_tokens / eval_trained_tokens: the same for the eval split.
        kind: ``sft`` (rows) or ``preference`` (rows are chosen/rejected pairs; tokens count both sequences,
            trained tokens are the completion tokens).
    """

    sources: list[SourceReport] = field(default_factory=list)
    dropped: list[dict] = field(default_factory=list)
    truncated_rows: list[dict] = field(default_factory=list)
    train_rows: int = 0
    eval_rows: int = 0
    train_sequences: int = 0
    eval_sequences: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    eval_tokens: int = 0
    eval_trained_tokens: int = 0
    max_length: int = 0
    packing: bool = False
    seed: int = 0
    kind: str = "sft"

    @property
    def truncated(self) -> int:
        """Number of kept rows that were cut to ``max_length``."""
        return len(self.truncated_rows)

    def cut_counts(self) -> dict[str, int]:
        """Where truncation cut: ``{prompt_cut_rows, prompt_tokens_cut, response_cut_rows, response_tokens_cut}``."""
        out = {}
        for part in ("prompt", "response"):
            cuts = [d.get(f"{part}_tokens_cut", 0) for d in self.truncated_rows]
            out[f"{part}_cut_rows"] = sum(1 for c in cuts if c > 0)
            out[f"{part}_tokens_cut"] = sum(cuts)
        return out

    def drop_counts(self) -> dict[str, int]:
        """``{reason kind: rows}``, most frequent first."""
        return dict(Counter(d["kind"] for d in self.dropped).most_common())

    def to_dict(self) -> dict:
        """JSON-ready dict: every field plus ``truncated`` (count), :meth:`cut_counts` and ``drop_counts``."""
        out = asdict(self)
        out["truncated"] = self.truncated
        out.update(self.cut_counts())
        out["drop_counts"] = self.drop_counts()
        return out

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON to ``path`` (parents created) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n")
        return path

    def sources_lineage(self) -> list[dict]:
        """``[{path, location, format, rows_read, sha256}]`` per source for ``lineage.json``.

        ``sha256`` is :func:`llmtune.utils.content_sha256` of what was read (the key of the data cache too): the
        file's bytes, or all files of a datasets directory with their relative names; None for hub datasets.
        """
        return [
            {"path": s.path, "location": s.location, "format": s.format, "rows_read": s.rows_read,
             "sha256": content_sha256(s.location)}
            for s in self.sources
        ]

    def summary(self, examples: int = 3) -> str:
        """A short human-readable table: per-source counts, drop reasons with example rows, truncation."""
        pct = 100.0 * self.trained_tokens / self.tokens if self.tokens else 0.0
        packed = f" packed into {self.train_sequences} sequences," if self.packing else ""
        rows = {"preference": "pairs", "prompt": "prompts"}.get(self.kind, "rows")
        trained = ("responses are generated" if self.kind == "prompt"
                   else f"{self.trained_tokens:,} trained, {pct:.1f}%")
        what = "prompt tokens" if self.kind == "prompt" else "train tokens"
        lines = [
            f"data: {self.train_rows} train {rows},{packed} {self.eval_rows} eval {rows}; {what} {self.tokens:,} "
            f"({trained}), max_length {self.max_length}",
        ]
        width = max([len(s.path) for s in self.sources] + [6])
        header = f"{'read':>7} {'valid':>7} {'kept':>7} {'train':>7} {'eval':>6}"
        lines.append(f"  {'source':<{width}}  {'format':<17} {header}")
        for s in self.sources:
            lines.append(
                f"  {s.path:<{width}}  {s.format:<17} {s.rows_read:>7} {s.rows_valid:>7} {s.rows_kept:>7} "
                f"{s.train_rows:>7} {s.eval_rows:>6}" + ("  (stopped at max_samples)" if s.stopped_early else "")
            )
            if s.skipped_rows or s.tool_rows:
                notes = [f"the first {s.skipped_rows:,} rows skipped (skip_rows)"] if s.skipped_rows else []
                notes += [f"{s.tool_rows:,} valid rows are tool conversations"] if s.tool_rows else []
                lines.append(f"    {'; '.join(notes)}")
            if s.truncated_json:
                t = s.truncated_json
                lines.append(
                    f"    JSON cut off at char {t['cut_at_char']:,} (line {t['cut_at_line']}); "
                    f"{t['records_kept']:,} complete records kept"
                )
        if self.dropped:
            lines.append(f"  dropped {len(self.dropped)} rows:")
            for kind, count in self.drop_counts().items():
                rows = [d for d in self.dropped if d["kind"] == kind][:examples]
                where = ", ".join(f"{d['source']} row {d['row']}" for d in rows)
                lines.append(f"    {count:>6}  {kind} (e.g. {where})")
        if self.truncated_rows:
            where = ", ".join(f"{d['source']} row {d['row']}" for d in self.truncated_rows[:examples])
            lines.append(f"  truncated {self.truncated} rows to {self.max_length} tokens (e.g. {where})")
            c = self.cut_counts()
            lines.append(f"    prompt: {c['prompt_tokens_cut']:,} tokens cut in {c['prompt_cut_rows']} rows; response: "
                         f"{c['response_tokens_cut']:,} tokens cut at the end in {c['response_cut_rows']} rows")
        return "\n".join(lines)
