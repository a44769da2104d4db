"""``python -m llmtune ...`` = the ``llmtune`` command (also what launchers run: ``torchrun -m llmtune sft R.yaml``)."""

from llmtune.commands.cli import main
from llmtune.core.launch import exit_process

exit_process(main())
