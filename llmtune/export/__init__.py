"""``llmtune export``: :mod:`~llmtune.export.merge` merges a run's adapter chain into its base model, saves it and
verifies the reload; :mod:`~llmtune.export.adapter` (``--adapter``) writes the chain as ONE peft adapter instead.
Importing this package imports neither (torch, transformers and peft load with the module that is used)."""
