"""Rollout: sampling responses. The backends (`hf`, `vllm`) share one contract (`base`):
`generate(batch, sampling) -> Batch`. Around them: multi-turn episodes (`multiturn`) with
their environments (`envs`), and DAPO's dynamic sampling (`dynamic_sampling`)."""
