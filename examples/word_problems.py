"""Writes ``examples/word_problems.jsonl``: short arithmetic word problems in TRL's standard form, one JSON object a
line with a ``prompt`` (the problem), an ``answer`` (the number, as text) and an ``op`` column (which operation),
the data docs/tasks.md trains on. Short on purpose: each prompt fits the quickstart model's 64-token context with
room for a two-digit answer, so the example runs on CPU in seconds.

    python examples/word_problems.py                      # the committed file: 240 problems, seed 0
    python examples/word_problems.py --rows 1000 --seed 1 --out /tmp/more.jsonl

The problems are a pure function of the seed (numbers 1..9, so every answer is 0..81).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Ivy"]
THINGS = ["apple", "cat", "cup", "hat", "pen", "egg"]
TEMPLATES = {  # op -> (problem, answer)
    "add": ("{name} has {a} {thing}s, gets {b} more. How many?", lambda a, b: a + b),
    "sub": ("{name} has {a} {thing}s, gives {b} away. How many?", lambda a, b: a - b),
    "mul": ("{a} bags of {b} {thing}s. How many {thing}s?", lambda a, b: a * b),
}


def word_problems(rows: int = 240, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        op = rng.choice(sorted(TEMPLATES))
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if op == "sub" and b > a:
            a, b = b, a
        text, answer = TEMPLATES[op]
        out.append({"prompt": text.format(name=rng.choice(NAMES), thing=rng.choice(THINGS), a=a, b=b),
                    "answer": str(answer(a, b)), "op": op})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=240)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("word_problems.jsonl")))
    args = parser.parse_args()
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in word_problems(args.rows, args.seed)))
    print(f"wrote {args.rows} problems to {args.out}")


if __name__ == "__main__":
    main()
