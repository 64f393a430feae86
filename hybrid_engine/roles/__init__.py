"""The engine's roles: the policy with its rollout and reference (`ActorRolloutRef`), the
critic and the reward model (`workers`), and the PPO update loop they share (`updates`)."""
