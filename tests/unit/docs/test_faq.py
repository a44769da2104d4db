"""The FAQ (docs/faq.md) and the troubleshooting page say only what the code has: every recipe key they name is a
schema key (a `train.extra_args` entry: a TrainingArguments field llmtune leaves to the user), every `llmtune ...`
command line names a real command and real options, and the FAQ is in the site's navigation."""

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from llmtune.config.options import recipe_options

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "docs" / "faq.md", ROOT / "docs" / "troubleshooting.md"]
SECTIONS = [s.name for s in recipe_options(None)]
KEY = re.compile(rf"^(?:{'|'.join(SECTIONS)})\.[a-z_0-9.]+$")
CODE = re.compile(r"`([^`\n]+)`")
FILE = re.compile(r"\.(?:md|ya?ml|json|jsonl|gz|gguf|py|sh)$")  # data.md, model.gguf: file names, not keys


def schema_keys() -> set[str]:
    keys = set()
    for section in recipe_options(None):
        for option in section.options:
            keys.add(option.key)
    return keys


def named_keys(text: str) -> list[str]:
    """Recipe keys in code spans: `a.b`, `a.b: value`, `a.b=value`, `a.b.0.c` (list index -> N)."""
    out = []
    for span in CODE.findall(text):
        head = re.split(r"[=: ]", span, maxsplit=1)[0]
        if KEY.match(head) and not FILE.search(head):
            out.append(re.sub(r"\.\d+(?=\.|$)", ".N", head))
    return out


def test_key_finder():
    text = "`data.chat_template` `train.extra_args: {ddp_timeout: 7200}` `output.overwrite=true` `data.datasets.0.path`"
    assert named_keys(text + " `llmtune.rewards:gsm8k_reward` `data.md` `model.gguf`") == [
        "data.chat_template", "train.extra_args", "output.overwrite", "data.datasets.N.path"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_recipe_keys_exist(page):
    keys = schema_keys()
    text = page.read_text()
    unknown = [k for k in named_keys(text) if k not in keys]
    assert not unknown, f"{page.name} names recipe keys the schema does not have: {unknown}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_extra_args_named_are_transformers_fields_llmtune_leaves_open(page):
    from transformers import TrainingArguments

    from llmtune.config.surface import OWNED

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    for name in re.findall(r"train\.extra_args: \{(\w+):", page.read_text()):
        assert name in fields and name not in OWNED, f"{page.name}: train.extra_args.{name}"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_command_lines_name_real_commands_and_options(page):
    from llmtune.commands.cli import build_parser

    commands = _subparsers(build_parser())
    for span in CODE.findall(page.read_text()):
        words = span.split()
        if len(words) < 2 or words[0] != "llmtune" or words[1].startswith("<"):  # `llmtune <command> --help`
            continue
        assert words[1] in commands, f"{page.name}: `{span}`: no command {words[1]!r}"
        options = {o for a in commands[words[1]]._actions for o in a.option_strings}
        for word in words[2:]:
            if word.startswith("--"):
                assert word.split("=")[0] in options, f"{page.name}: `{span}`: llmtune {words[1]} has no {word}"


def test_faq_is_in_the_navigation():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    assert "faq.md" in str(nav)
