"""Finding the vLLM venv that ``scripts/setup.sh`` builds, as a user's shell does: with neither
``LLMTUNE_VLLM_PYTHON`` nor ``LLMTUNE_VLLM_VENV`` set (issue 38: ``scripts/test.sh`` exports the first, which hid a
lookup computed from a module's depth inside the package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.rl.engines import vllm_client
from llmtune.utils import project_root

REPO = Path(__file__).resolve().parents[3]


def _plain_env() -> dict[str, str]:
    """The environment of a user's shell after `source .venv/bin/activate`: none of the test script's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMTUNE_")}
    env.pop("PYTHONPATH", None)
    return env


def test_project_root_is_the_checkout():
    assert project_root() == REPO
    assert (REPO / "scripts" / "setup.sh").is_file()


def test_the_venv_beside_the_running_venv_is_found(tmp_path, monkeypatch):
    """setup.sh's rule: .venv-vllm beside $LLMTUNE_VENV (here a venv outside the checkout)."""
    for name in ("LLMTUNE_VLLM_PYTHON", "LLMTUNE_VLLM_VENV"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv-vllm" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    assert vllm_client.vllm_python() == str(python)


def test_a_missing_venv_is_named_in_the_error(tmp_path, monkeypatch):
    for name in ("LLMTUNE_VLLM_PYTHON", "LLMTUNE_VLLM_VENV"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "elsewhere" / ".venv"))
    message = str(vllm_client.not_installed_error())
    assert str(tmp_path / "elsewhere" / ".venv-vllm" / "bin" / "python") in message
    assert "scripts/setup.sh" in message


@pytest.mark.skipif(not (Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python").is_file(),
                    reason="no .venv-vllm beside this venv (LLMTUNE_SKIP_VLLM=1 setup)")
def test_the_real_lookup_in_a_plain_shell_finds_setups_venv():
    """In a subprocess with no LLMTUNE_* variable, the real lookup finds the venv scripts/setup.sh built."""
    out = subprocess.run(
        [sys.executable, "-c", "from llmtune.rl.engines.vllm_client import vllm_python; print(vllm_python())"],
        env=_plain_env(), cwd="/", capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert out == str(Path(sys.prefix).parent / ".venv-vllm" / "bin" / "python")
