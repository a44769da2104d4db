"""Errors whose message is meant for the user, and the process exit codes of every command.

Lowest layer of the package (next to :mod:`llmtune.utils`): imports nothing from llmtune. The CLI prints a
:class:`LlmtuneError` as ``error: <message>`` (no traceback) and exits with its ``exit_code``.

Exit codes (documented in README "When things go wrong"):

====  =====================================================================================================
0     finished
1     a problem in the recipe, data, files or model: the message says what, where and how to fix it
2     command-line usage (argparse)
3     stopped: non-finite loss or gradient norm in too many optimizer steps in a row
4     out of GPU memory: the message lists what to change
5     disk full, or a checkpoint/artifact could not be written (the previous checkpoint is intact)
69    the rollout engine (vLLM) is unavailable: it failed to start, is unreachable or died; the newest checkpoint is
      intact: fix/restart it and rerun the same command (EX_UNAVAILABLE)
75    stopped by SIGTERM/SIGUSR1 (preemption) after writing a checkpoint: rerun the same command (EX_TEMPFAIL)
130   interrupted by Ctrl-C (SIGINT)
====  =====================================================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NONFINITE = 3
EXIT_OOM = 4
EXIT_DISK = 5
EXIT_ENGINE = 69
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class LlmtuneError(Exception):
    """Base of every error whose message is for the user (printed without a traceback).

    Subclasses set ``exit_code`` (one of the ``EXIT_*`` constants above).
    """

    exit_code: int = EXIT_ERROR
