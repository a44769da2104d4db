"""`llmtune validate` of a hub model needs its config and tokenizer files only, never its weights (issue 38): a
tokenizer-only snapshot in the Hugging Face cache validates, offline and with the hub unreachable, and the errors
say how to get one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.models.tiny import save_tiny_model

REPO = Path(__file__).resolve().parents[3]
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """An HF cache holding some-org/tiny as `hf download ... --exclude '*.safetensors'` leaves it."""
    root = tmp_path_factory.mktemp("hf")
    model = save_tiny_model(root / "full")
    repo = root / "hub" / "models--some-org--tiny"
    snap = repo / "snapshots" / SHA
    snap.mkdir(parents=True)
    for file in model.iterdir():
        if not file.name.endswith(".safetensors"):
            (snap / file.name).write_bytes(file.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    return root / "hub"


def validate(hub_cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    return subprocess.run([sys.executable, "-m", "llmtune.commands.cli", "validate", "recipes/quickstart_sft.yaml",
                           "model.name_or_path=some-org/tiny", "data.datasets.0.max_samples=40", "data.val_size=4",
                           *args], cwd=REPO, env={**base, "HF_HUB_CACHE": str(hub_cache), **env},
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("network", ["offline", "unreachable"])
def test_a_tokenizer_only_snapshot_validates(hub_cache, network):
    env = {"HF_HUB_OFFLINE": "1"} if network == "offline" else {"HF_ENDPOINT": "http://127.0.0.1:9"}
    done = validate(hub_cache, **env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "valid:" in done.stdout and "no weights yet" in done.stdout


def test_a_missing_hub_model_names_the_tokenizer_only_download(tmp_path):
    done = validate(tmp_path, HF_ENDPOINT="http://127.0.0.1:9")
    assert done.returncode == 1
    assert "hf download some-org/tiny --exclude '*.safetensors'" in done.stderr
    assert "Traceback" not in done.stderr
