"""The user-facing commands (top layer): :mod:`~llmtune.commands.cli` (argument parsing, dispatch, error -> exit
code), :mod:`~llmtune.commands.validate` (``llmtune validate``, the dry run) and :mod:`~llmtune.commands.chat`
(``llmtune chat``). Nothing in llmtune imports this package except ``llmtune/__main__.py``."""
