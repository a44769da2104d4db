"""``llmtune rollout-server RECIPE``: build a recipe's rollout base and run the vLLM rollout server on it (see
:mod:`llmtune.rl.engines.vllm_engine`)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def rollout_server_command(recipe_path: str, overrides: list[str], host: str, port: int,
                           print_only: bool = False) -> int:
    """Build the rollout base of the recipe, print the server's plain command line, then run it (replaces this
    process: signals reach the server directly).

    Raises:
        RolloutEngineError: vLLM is not installed.
    """
    from llmtune.config import load_recipe
    from llmtune.rl.engines.vllm_engine import settings_from_recipe
    from llmtune.rl.engines.vllm_base import base_identity, rollout_base
    from llmtune.rl.engines.vllm_client import not_installed_error, server_command, server_env, vllm_python

    recipe = load_recipe(recipe_path, overrides)
    python = vllm_python()
    if python is None and not print_only:
        raise not_installed_error()
    base = rollout_base(recipe, Path(recipe.output.dir + ".rollout_base"))  # the run directory stays empty
    cmd = server_command(python or "VLLM_PYTHON", base, settings_from_recipe(recipe), host=host, port=port,
                         base_id=base_identity(recipe))
    print("rollout server (the trainer's rollout.vllm.url: http://%s:%d):\n  %s" % (host, port, shlex.join(cmd)),
          file=sys.stderr, flush=True)
    if print_only:
        return 0
    os.execve(cmd[0], cmd, server_env())
    return 0  # not reached
