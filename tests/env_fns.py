"""Environments and tools for the tests (`rollout.multi_turn.environment: env_fns:<Class>`,
tools as `env_fns:<function>`)."""

import time

from hybrid_engine.rollout.envs import Environment, Step


class TwoTurns(Environment):
    """Asks once more after the first answer; gives no reward, so the configured scorer
    (e.g. reward_fns:length_score) scores the final answer: a signal on a random model."""

    def reset(self, row, seed):
        self.turn = 0
        return [dict(m) for m in row["prompt"]]

    def step(self, assistant_text):
        self.turn += 1
        if self.turn == 1:
            return Step(
                [{"role": "user", "content": "Are you sure? Answer again."}], None, False, {}
            )
        return Step(None, None, True, {})


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: int) -> int:
    """Always raises.

    Args:
        x: ignored
    """
    raise RuntimeError(f"boom {x}")


def hang(x: int) -> int:
    """Never returns.

    Args:
        x: ignored
    """
    while True:
        time.sleep(0.1)


def huge(x: int) -> str:
    """Returns 1 MB of text.

    Args:
        x: ignored
    """
    print("noise on stdout")
    return "y" * 1_000_000
