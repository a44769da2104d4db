"""README.md is the front page: short, states the command CI runs, and every relative link in it (into docs/,
recipes/, scripts/ ...) reaches an existing file and, for a Markdown page, an existing heading. mkdocs --strict
checks the links between the pages of docs/; README.md is outside the site, so this test checks its links."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs uses for anchors): code marks dropped, lower case, characters other
    than word characters, spaces and hyphens removed, runs of spaces and hyphens turned into one hyphen."""
    text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # '#' lines in code blocks are no headings
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def test_readme_is_a_front_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; guides belong in docs/ (README is the front page)"


def test_readme_states_the_ci_test_command():
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#") and not ln.startswith(("set ", "cd "))]
    assert ci, ".ci/run runs no command"
    assert ci[-1] in README.read_text(), f"README.md does not state the command CI runs: {ci[-1]!r}"


def test_readme_links_resolve():
    problems = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        page = (ROOT / path) if path else README
        if not page.exists():
            problems.append(f"{target}: {path} does not exist")
        elif anchor and page.suffix == ".md" and anchor not in anchors(page):
            problems.append(f"{target}: no heading with anchor #{anchor} in {path or 'README.md'}")
    assert not problems, "README.md links:\n" + "\n".join(problems)


def test_slug_matches_mkdocs_anchors():
    assert slug("Server mode and `llmtune rollout-server`") == "server-mode-and-llmtune-rollout-server"
    assert slug("Optional data (`when_missing`)") == "optional-data-when_missing"
    assert slug("Multi-GPU, multi-node, SLURM and DeepSpeed ZeRO") == "multi-gpu-multi-node-slurm-and-deepspeed-zero"
