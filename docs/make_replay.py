"""Make docs/replay.png, the replay figure README.md shows: a real CPU run recorded by ``asyncrl run`` (the
quickstart preset, ``in_order`` L=1, 60 steps, completions of up to 8 tokens with long-tailed limits) replayed by
``asyncrl replay`` under the five samplers (the four built in and ``notebooks/my_sampler.NewestFirst``).

    PYTHONPATH=.:notebooks python docs/make_replay.py
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "notebooks")]

from asyncrl import cli  # noqa: E402

SAMPLERS = ["in_order", "weight_fifo", "{name: windowed, max_staleness_versions: 0}", "ready_first",
            "{name: custom, target: 'my_sampler:NewestFirst', max_lag: 1}"]


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="make-replay-"))
    try:
        run = work / "run"
        assert cli.main(["run", "quickstart", "--steps", "60", "--out", str(run), "--quiet", "--no-plot",
                         "--set", "eval_every=null", "--set", "torch_threads=1",
                         "--set", "generation.max_new_tokens=8", "--set", "generation.min_new_tokens_tail=2"]) == 0
        assert cli.main(["replay", str(run), *[a for s in SAMPLERS for a in ("--sampler", s)],
                         "--out", str(work / "replay")]) == 0
        shutil.copy(work / "replay" / "replay.png", ROOT / "docs" / "replay.png")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {ROOT / 'docs' / 'replay.png'}")


if __name__ == "__main__":
    main()
