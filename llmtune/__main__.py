"""``python -m llmtune ...`` = the ``llmtune`` command (also what launchers run: ``torchrun -m llmtune sft R.yaml``)."""

from llmtune.cli import main
from llmtune.launch import exit_process

exit_process(main())
