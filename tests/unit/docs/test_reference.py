"""The generated references (docs/reference/*.md) are what scripts/gen_docs.py makes from the code today, and they
cover everything `llmtune --help` and the recipe schema offer."""

import argparse
import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["recipe.md", "cli.md"])
def test_committed_reference_is_up_to_date(gen_docs, name):
    path = ROOT / "docs" / "reference" / name
    fresh = gen_docs.OUTPUTS[path]()
    assert path.is_file(), f"{path} is missing: run python scripts/gen_docs.py"
    assert path.read_text() == fresh, f"{path.relative_to(ROOT)} is out of date: run python scripts/gen_docs.py"


def test_check_mode_names_a_stale_file(gen_docs, monkeypatch, tmp_path, capsys):
    stale = tmp_path / "cli.md"
    stale.write_text("old\n")
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    monkeypatch.setattr(gen_docs, "OUTPUTS", {stale: gen_docs.render_cli_reference})
    assert gen_docs.main(["--check"]) == 1
    assert "cli.md" in capsys.readouterr().err and stale.read_text() == "old\n"
    assert gen_docs.main([]) == 0 and stale.read_text() == gen_docs.render_cli_reference()
    assert gen_docs.main(["--check"]) == 0


def _schema_keys(cls: type[BaseModel], prefix: str) -> list[str]:
    """Every leaf key of a schema section, walked here independently of llmtune.config.options."""
    from llmtune.config.schema import DatasetConfig

    keys = []
    for name, field in cls.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _schema_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    if cls is not DatasetConfig and "datasets" in cls.model_fields:
        keys += _schema_keys(DatasetConfig, f"{prefix}datasets.N.")
    return keys


def test_recipe_reference_has_every_schema_key_with_its_help():
    from llmtune.config.schema import SECTIONS

    text = (ROOT / "docs" / "reference" / "recipe.md").read_text()
    anchors = set(re.findall(r"^#+ .*\{ #([\w.-]+) \}$", text, flags=re.M))
    keys = [k for section, cls in SECTIONS.items() for k in _schema_keys(cls, f"{section}.")]
    assert len(keys) > 150
    missing = [k for k in keys if k not in anchors]
    assert not missing, f"recipe.md has no heading for {missing}: run python scripts/gen_docs.py"
    # the help text follows its heading (checked on a key whose help has no Markdown-special characters)
    assert re.search(r"\{ #train\.learning_rate \}\n\n`float` · default `[^`]+`\n\n\S", text)


def _help_tokens(parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """Subcommands and --options as `llmtune ... --help` prints them (read from the help text, not the parser)."""
    text = parser.format_help()
    options = sorted(set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", text.split("recipe options")[0])))
    commands = re.findall(r"^    ([a-z][\w-]*)(?:\s|$)", text.split("COMMAND\n", 1)[-1].split("\n\n")[0], flags=re.M)
    return commands, options


def test_cli_reference_has_every_command_and_option_of_help(gen_docs):
    text = (ROOT / "docs" / "reference" / "cli.md").read_text()
    parser = gen_docs.build_parser()  # the CLI's parser, imported in one place (scripts/gen_docs.py)
    commands, options = _help_tokens(parser)
    assert {"sft", "dpo", "grpo", "validate", "export", "pipeline", "chat", "rollout-server"} <= set(commands)
    for opt in options:
        assert f"`{opt}" in text, f"cli.md lacks {opt} of llmtune --help"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in commands:
        assert f"## `llmtune {command}` {{ #{command} }}" in text
        section = text.split(f"{{ #{command} }}")[1].split("\n## ")[0]
        _, sub_options = _help_tokens(sub.choices[command])
        assert sub_options, command
        for opt in sub_options:
            assert f"`{opt}" in section, f"cli.md's llmtune {command} section lacks {opt} of its --help"
