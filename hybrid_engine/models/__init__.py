"""Models: where weights come from (`loading`), log-probs over response tokens (`logprobs`),
LoRA adapters (`lora`), and the training / rollout layouts with the resharding between them
(`sharding`)."""
