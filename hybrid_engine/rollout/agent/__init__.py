"""Bring your own agent: an OpenAI-compatible endpoint served by the policy during the
rollout (`endpoint`, `chat`), the user's agent function run against it (`runner`), and the
token-exact training sequences made from the recorded calls (`episodes`)."""
