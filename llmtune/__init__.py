"""llmtune: staged fine-tuning (SFT, RM, DPO, PPO) of causal language models from YAML recipes.

Shape notation used in docstrings: B = sequences per micro-batch (per device), T = tokens per
sequence (padded), V = vocabulary size. Labels are -100 at positions that are not trained.

Import direction: cli > stages > core, data, models > config > utils (lower layers never import upper).
"""

__version__ = "0.1.0"
