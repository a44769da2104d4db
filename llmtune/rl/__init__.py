"""What the online-RL stages (PPO, GRPO) share: the trainer that feeds rollouts into transformers' loop, the
generation backend, per-token log-probs of the policy and the reference, reward sources, KL estimators, sample logs
and the greedy evaluation. Import direction: ``stages > rl > core, data, models``."""
