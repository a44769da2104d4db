"""``llmtune pipeline RECIPE``: run a list of stages into one directory, resumably, and export the result.

A pipeline recipe has one section::

    pipeline:
      dir: runs/my_pipeline            # every step writes <dir>/<name>; the export goes to <dir>/merged
      stages:
        - {name: sft, recipe: sft.yaml, overrides: {train.max_steps: 30}}      # a recipe file (relative to
        - name: pairs                                                          #   this file) or a mapping
          kind: pairs                  # on-policy preference pairs (see PairsStep)
          from: sft
          data: {datasets: [{path: builtin:gsm8k, max_samples: 64}]}
          reward: {function: llmtune.rewards:gsm8k_reward}
        - {name: dpo, stage: dpo, recipe: {data: {datasets: [{path: "{pairs}"}]}}}
      export: {dtype: fp32}

Wiring: ``output.dir`` = ``<dir>/<name>``; ``model.from_run`` = the latest earlier policy step (sft/dpo/ppo/grpo:
stages with a causal-LM head), for ``rm`` too (InstructGPT initialises the reward model from the SFT model);
``ppo``'s and ``grpo``'s ``reward.from_run`` = the latest earlier ``rm`` step unless it sets a reward function. A run
directory the step sets in its inline recipe or ``overrides`` wins; one named inside a recipe FILE (e.g. ``from_run:
runs/quickstart_sft`` of a standalone recipe) is rewired. A string ``"{NAME}"`` (or ``"{NAME}/sub/path"``)
anywhere in a step names an earlier step's artifact: its run directory, or for a pairs step its ``pairs.jsonl``.
A data source may carry ``when_missing: {path: ..., format: ...}``, the source used instead when its ``path`` does
not exist (e.g. HH-RLHF pairs if the file is there, else on-policy pairs); a pairs step no later step reads is
not run.

State on disk decides what runs, so the same command continues after Ctrl-C or a kill:

* a complete step (``lineage.json``; ``pairs_report.json`` for pairs) trained with the recipe that would run now
  is skipped and left untouched; with another recipe the pipeline stops and says to remove the directory or set
  ``NAME.output.overwrite=true`` (pairs: ``NAME.overwrite=true``);
* a step with checkpoints but no ``lineage.json`` resumes from the latest one (``train.resume_from=latest``);
  a pairs step continues after its last complete batch of prompts (``samples.jsonl``);
* a partial step without a checkpoint restarts; a step whose input (an earlier step) was finished after it
  started is stale and is trained again.

Stages run in this process, one after another, through :func:`llmtune.core.runner.run_stage` (the code of
``llmtune sft|rm|dpo|ppo``): no Python start and torch import per stage, and Ctrl-C reaches the trainer directly
(its checkpoints stay). Each stage's objects are dropped and garbage-collected before the next one. A stage that
asks for several processes or DeepSpeed is started through torchrun like ``llmtune <stage>`` does
(:mod:`llmtune.core.launch`, with its resolved recipe in ``<dir>/<name>.launch.yaml``); run the pipeline command itself
without a launcher.

Overrides on the command line name the step: ``sft.train.max_steps=10``, ``pairs.k=2``,
``pipeline.export.dtype=bf16``.

Modules: :mod:`~llmtune.pipeline.spec` (the pipeline recipe: schema, loading, validation), :mod:`~llmtune.pipeline.run`
(what runs: disk state, training, pairs, export, summaries), :mod:`~llmtune.pipeline.pairs` (on-policy preference
pairs).
"""
