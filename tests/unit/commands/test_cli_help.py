"""What a user sees: --help is fast (imports no trainer), lists only the stage's recipe sections with readable
types and the dotted index syntax the overrides accept; no bitsandbytes kernel notice; rich tables keep their width
when redirected to a file."""

import subprocess
import sys

import pytest

from llmtune.commands.cli import main, options_help, stage_names
from llmtune.config.options import type_name


def test_help_imports_neither_transformers_nor_bitsandbytes():
    code = ("import sys\nfrom llmtune.commands.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['sft', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'bitsandbytes', 'llmtune.stages') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]"
    assert "kernels" not in out.stderr


@pytest.mark.parametrize("command", ["validate", "sft"])
def test_a_recipe_error_imports_no_torch(tmp_path, command):
    """A recipe error is reported from the config package alone (was ~5 s of torch/transformers/peft imports)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("stage: sft\ntrain: {lerning_rate: 0.1}\n")
    code = (f"import sys\nfrom llmtune.commands.cli import main\nrc = main([{command!r}, {str(recipe)!r}])\n"
            "print(rc, sorted(m for m in ('torch', 'transformers', 'peft', 'llmtune.stages') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "1 []", out.stderr
    assert "train.lerning_rate: unknown key; did you mean 'learning_rate'?" in out.stderr


def test_stage_commands_are_the_registry():
    from llmtune.stages import STAGES

    assert stage_names() == list(STAGES)


def test_stage_help_lists_only_its_sections_with_readable_types(capsys):
    with pytest.raises(SystemExit):
        main(["sft", "--help"])
    out = capsys.readouterr().out
    assert "model.from_run  (str or null; default None)" in out and "data.datasets.N.path  (str; required)" in out
    assert "  dpo." not in out and "  ppo." not in out and "  reward." not in out
    assert "[i]" not in out and "Union" not in out and "Optional" not in out and "typing" not in out
    ppo = options_help("ppo")
    assert "ppo.kl_coef" in ppo and "reward.function" in ppo and "dpo.beta" not in ppo
    assert "dpo.beta" in options_help() and "rm.margin" in options_help()  # validate: every section


def test_type_names():
    from typing import Annotated, Literal

    assert type_name(int | None) == "int or null"
    assert type_name(Annotated[list[str], "x"] | str) == "list of str or str"
    assert type_name(Literal["a", "b"]) == "a | b"
    assert type_name(dict[str, str]) == "mapping of str"


def test_overrides_accept_the_index_syntax_the_help_shows():
    from llmtune.config import load_recipe

    recipe = load_recipe(raw={"data": {"datasets": [{"path": "a.jsonl"}]}},
                         overrides=["data.datasets.0.columns={instruction: q}"])
    assert recipe.data.datasets[0].columns == {"instruction": "q"}


def test_bitsandbytes_kernel_notice_is_dropped_and_other_messages_pass(caplog):
    import logging

    import llmtune  # noqa: F401  (installs the filter)

    bnb = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING, logger="bitsandbytes.backends.cpu.ops"):
        bnb.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "No module")
        bnb.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_rich_tables_are_not_cut_at_80_columns_in_a_file(tmp_path):
    code = ("from rich.table import Table\nfrom llmtune.utils import make_console\nt = Table()\n"
            "t.add_column('key')\nt.add_column('value')\nt.add_row('run_dir', '/a/very/long/path/' * 8)\n"
            "make_console(stderr=False).print(t)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert ("/a/very/long/path/" * 8) in out.replace("\n", "")  # one row, uncut
    assert max(len(line) for line in out.splitlines()) > 80


@pytest.mark.parametrize(("command", "promise"), [("validate", False), ("sft", True)])
def test_ctrl_c_speaks_of_checkpoints_only_for_commands_that_write_them(command, promise, monkeypatch, capsys):
    import llmtune.commands.cli as cli
    import llmtune.commands.validate as validate

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(validate, "validate_command", interrupted)
    monkeypatch.setattr(cli, "run_stage_command", interrupted)
    assert cli.main([command, "recipe.yaml"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and ("checkpoints" in err) == promise


def test_overrides_after_flags_are_overrides_in_order():
    """`llmtune sft R.yaml --nproc-per-node 8 distributed.zero_stage=2` (argparse alone: 'unrecognized arguments')."""
    from llmtune.commands.cli import parse_command_line

    args = parse_command_line(["sft", "r.yaml", "train.max_steps=3", "--nproc-per-node", "2",
                               "distributed.zero_stage=2", "train.max_steps=4"])
    assert args.recipe == "r.yaml" and args.nproc_per_node == 2
    assert args.overrides == ["train.max_steps=3", "distributed.zero_stage=2", "train.max_steps=4"]
    args = parse_command_line(["pipeline", "p.yaml", "--dry-run", "sft.train.max_steps=2"])
    assert args.dry_run and args.overrides == ["sft.train.max_steps=2"]


def test_an_unknown_flag_is_still_a_usage_error(capsys):
    from llmtune.commands.cli import parse_command_line

    with pytest.raises(SystemExit) as exc:
        parse_command_line(["sft", "r.yaml", "--workers", "2", "train.max_steps=3"])
    assert exc.value.code == 2 and "unrecognized arguments: --workers 2" in capsys.readouterr().err
