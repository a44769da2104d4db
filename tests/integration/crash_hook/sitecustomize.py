"""Test hook for the crash-safety tests: imported at interpreter start when this directory is on PYTHONPATH.

``LLMTUNE_TEST_PAUSE=WHERE:STEP:FLAG[:SECONDS]`` makes a real ``python -m llmtune ...`` run pause at a chosen point,
after creating the file FLAG, so that a test's kill or signal lands exactly there:

* ``save``: inside the save of checkpoint STEP, after the adapter and optimizer files are written (before the RNG
  states, trainer_state.json and the completeness marker);
* ``commit``: inside the save of checkpoint STEP, after the marker is written, before the rename;
* ``step``: inside the training step that follows optimizer step STEP (between two checkpoints);
* ``first``: at the first training step of the process, whatever its step (STEP is ignored; use SECONDS=0 to only
  mark the start of training).

The pause lasts SECONDS (default 600: until the test kills the process). Nothing here is used by llmtune itself.
"""

import os
import time

_spec = os.environ.get("LLMTUNE_TEST_PAUSE")
if _spec:
    where, step, flag, *rest = _spec.split(":")
    step, seconds = int(step), float(rest[0]) if rest else 600.0

    def _pause():
        open(flag, "w").close()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(0.05)

    from llmtune.core import checkpoint as _ck
    from llmtune.core import trainer as _trainer

    if where == "save":
        _orig_rng = _trainer.CoreTrainer._save_rng_state

        def _save_rng_state(self, output_dir):
            if self.state.global_step == step:
                _pause()
            return _orig_rng(self, output_dir)

        _trainer.CoreTrainer._save_rng_state = _save_rng_state
    elif where == "commit":
        _orig_commit = _ck.commit

        def _commit(staged, final):
            if _ck.step_of(final) == step:
                _pause()
            return _orig_commit(staged, final)

        _ck.commit = _commit
    elif where in ("step", "first"):
        _orig_step = _trainer.CoreTrainer.training_step
        _seen = []

        def _training_step(self, *args, **kwargs):
            if (where == "step" and self.state.global_step == step) or (where == "first" and not _seen):
                _seen.append(1)
                _pause()
            return _orig_step(self, *args, **kwargs)

        _trainer.CoreTrainer.training_step = _training_step
