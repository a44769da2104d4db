"""``python -m llmtune ...`` = the ``llmtune`` command (also what launchers run: ``torchrun -m llmtune sft R.yaml``)."""

import sys

from llmtune.cli import main

sys.exit(main())
