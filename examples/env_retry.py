"""A multi-turn environment of your own, on any task's rows: answer, be told when you are wrong, try again.

    torchrun --standalone --nproc_per_node 2 train_ppo.py --task addition --env examples/env_retry.py:RetryEnv --max-turns 3

The class is built once per episode. reset gets the task row (its columns); step gets the model's turn as text and
returns (observation, reward, done): the observation is the next user message (None only when done).
"""


class RetryEnv:
    retry_reward = 0.5  # a right answer after a wrong one is worth less than a right first answer

    def reset(self, row: dict) -> str:
        self.answer, self.tries = row["answer"], 0
        return row["prompt"]

    def step(self, text: str):
        self.tries += 1
        if text.strip() == self.answer:
            return None, 1.0 if self.tries == 1 else self.retry_reward, True
        return "wrong, try again", 0.0, False
