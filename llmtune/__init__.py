"""llmtune: staged fine-tuning (SFT, RM, DPO, PPO) of causal language models from YAML recipes.

Shape notation used in docstrings: B = sequences per micro-batch (per device), T = tokens per
sequence (padded), V = vocabulary size. Labels are -100 at positions that are not trained.

Layers, imports pointing down only (tests/unit/test_layers.py; docs/contributing.md): commands > pipeline, export >
stages > rl > core > models > data > config > errors, utils.
"""

__version__ = "0.1.0"

import logging as _logging


class _DropOptionalKernelNotice(_logging.Filter):
    """bitsandbytes' CPU backend tries the optional ``kernels`` package (a faster 4-bit CPU matmul from the hub) at
    import and, when it is missing, warns and uses its own kernel, which gives the same results. The notice is not
    actionable (installing ``kernels`` downloads code at run time) and was printed by every command, ``--help``
    included; it is dropped here, any other bitsandbytes message passes."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "from kernels-community" not in str(record.msg)


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropOptionalKernelNotice())
