"""Regenerate the agent examples' task files (llmtune/data/builtin/agent-*.jsonl.gz) and print their SHA-256.

The rows come from fixed seeds (llmtune.data.agent_tasks): the same code writes the same bytes. After a change to the
generator, put the printed digests into MULTIPLY_SHA256 / ROOMS_SHA256 of llmtune/data/sources.py.
Run: python scripts/make_agent_tasks.py
"""

from llmtune.data.agent_tasks import write_builtin_files
from llmtune.utils import content_sha256

if __name__ == "__main__":
    for path in write_builtin_files():
        print(f"{path}  {path.stat().st_size:,} bytes  sha256 {content_sha256(path)}")
