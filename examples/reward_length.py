"""An example --reward: exact match, minus a penalty for every character beyond the row's `max_chars` column.

    train_ppo.py --task my_data.jsonl --reward examples/reward_length.py:length_penalised

Each row of my_data.jsonl has "prompt", "answer" and "max_chars" (an int; null = no limit). The function
receives `max_chars` by name, as a list aligned with the completions. It returns a dict per sample: "score"
is the reward, "chars" is logged as reward/chars (the batch mean), and "pred" (the stripped completion) is
what maj@k votes on. A completion that is empty gets None: no reward, so it is left out of training.
"""


def length_penalised(completions, *, prompts, answer, max_chars, **columns):
    out = []
    for completion, ref, limit in zip(completions, answer, max_chars, strict=True):
        text = completion.strip()
        if not text:
            out.append(None)
            continue
        over = max(0, len(text) - limit) if limit is not None else 0
        out.append({"score": float(text == ref.strip()) - 0.1 * over, "chars": len(text), "pred": text})
    return out
