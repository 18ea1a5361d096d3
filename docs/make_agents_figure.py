"""Make docs/agents.png, the figure of conversations by version README.md shows: a real CPU run of the
``guess_letter`` preset (a text environment: the model guesses a secret letter, told ``higher`` / ``lower`` /
``correct`` after each turn), stepped one rollout tick and one train tick at a time so that weight syncs land
between the turns of groups in flight; then the last trained groups' conversations turn by turn, each model turn
tinted by the weight version that generated it, the environment's replies grey (untrained).

    PYTHONPATH=. python docs/make_agents_figure.py [--steps N]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from asyncrl import Controller, load_config  # noqa: E402
from asyncrl.plots import GUESS_LETTER_REPLIES, conversation_figure, conversation_groups  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "agents.png")
    parser.add_argument("--groups", type=int, default=16, help="groups per step (the preset's on the agents branch)")
    args = parser.parse_args()
    cfg = load_config("guess_letter", groups_per_step=args.groups, group_size=8, eval_every=None, torch_threads=1,
                      trainer={"lr": 1e-3},
                      sampler={"name": "in_order", "max_lookahead_versions": 1})
    ctrl = Controller.from_config(cfg)
    while ctrl.trainer_version < args.steps:
        ctrl.rollout_tick()
        ctrl.train_tick()
    groups = conversation_groups(ctrl)
    spanning = groups[groups.turn_versions.map(len) > 1]  # groups whose turns came from two weight versions
    shown = list(spanning.group_id.tail(2)) or list(groups.group_id.tail(2))
    fig = conversation_figure(ctrl, shown, replies=GUESS_LETTER_REPLIES)
    fig.suptitle(f"guess_letter after {ctrl.trainer_version} steps: the model guesses a secret letter of "
                 f"'{ctrl.task.alphabet}', told higher / lower / correct", fontsize=10)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: groups {shown}")


if __name__ == "__main__":
    main()
