"""Online RL (PPO, GRPO), in the order data flows: prompt rows -> a rollout engine (:mod:`llmtune.rl.engines`: token
ids in, token ids + log-probs + a finish reason out; :mod:`llmtune.rl.rollouts`) -> typed trajectories and a padded
rollout batch (:mod:`llmtune.rl.types`) -> rewards (:mod:`llmtune.rewards.shaping`: one result, one mask) -> the
stage's experience (advantages, and the rollout forwards of :mod:`llmtune.rl.forward`) -> the learner
(:mod:`llmtune.rl.trainer`, transformers' loop) -> ``stage.loss``; one iteration reads top to bottom in
:mod:`llmtune.rl.iteration`; weights reach an engine only through ``engine.sync(version)``. Import direction:
``stages > rl, rewards > core, data, models``."""
