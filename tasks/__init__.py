"""Prefect tasks, one per stage (rollout, reward, advantage, update).

Not built yet: the stage pipeline issue adds them. Until then `hybridrl train` drives the
engine's four stage calls from a plain in-process loop (`hybrid_engine.trainer.train`).
"""
