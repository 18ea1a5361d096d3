"""Multi-turn rollouts: ``TurnGenerator`` drives a group's trajectories through the generator turn by turn, with
the environment's replies in between (docs/environments.md).

It is a ``GenerationBackend`` over the run's generator (what it does not own it passes through), so the rollout
pump dispatches, polls, aborts and commits a multi-turn group as any other; the pump binds two callbacks
(``bind``): ``on_turn`` (a ``turn`` trace event) and ``at_boundary`` (the sampler asked at every turn boundary
whether the group is to be stopped; the pump aborts it there), and takes the trajectories that failed for good
(``take_failed``: it regenerates their groups within ``faults.max_dispatch_attempts``, else skips them).

Invariants:
- Token custody: a trajectory's tokens are the prompt, then each model turn's tokens exactly as sampled (never
  re-tokenised), then each observation's: the chat template's rendering of the conversation so far minus the
  text already held (a prefix check; a template that re-renders earlier turns fails it and the trajectory is given
  up naming it), encoded on its own. Raw text (a model without a chat template): the observation's text encoded.
  Only sampled tokens have ``trained_mask`` 1 and a logprob; ``token_versions`` lists their versions.
- A poll advances every trajectory by at most one turn: it generates the turns requested at the previous poll
  (one ``submit`` to the inner generator for all of them: one batched decode on the torch engine, in a fixed
  order), calls the environments, and requests the next turns. A stepped run is deterministic for a seed. An
  asynchronous sampler's running pump lets trajectories go on as their environment answers
  (``asyncrl/environments/free_turns.py``).
- Each turn is generated at the inner generator's version then (``turn_versions``); a group's
  ``gen_start_version`` is its first turn's, ``gen_end_version`` its last's.
- One environment instance per trajectory (``asyncrl.environments.host``), made and reset when the group starts,
  dropped when the group ends, fails or is aborted. A trajectory is done when its environment says so (text: ``done``
  or no observation; tool: a turn without a tool call) or after ``max_turns`` model turns; the group is returned
  when all its trajectories are done, with the environment's rewards (``get_reward`` or the sum of ``step``'s).
- Threads: the pump polls on its thread while the train pump may abort on another; ``_lock`` guards the groups
  and is never held while generating, calling an environment or calling back into the pump (its state's lock).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from asyncrl.data import GenerationRequest, GroupRollouts
from asyncrl.environments import EnvironmentKind, parse_tool_calls
from asyncrl.environments.free_turns import FreeTurns
from asyncrl.environments.host import EnvironmentHost
from asyncrl.environments.trajectory import Group, Trajectory, cut_contents, reward_batch

ENVIRONMENT_REWARD = "environment"  # reward/environment: the environment's part of a trajectory's reward


class TurnGenerator(FreeTurns):
    """Multi-turn groups over ``inner`` (see the module's invariants). ``kind``: the environment class's
    (``asyncrl.environments.describe_class``); ``prompt_of(gid)``: the group's ``Prompt``; ``chat_template``: the
    run's ``model.chat_template`` (None: the tokenizer's own; a tokenizer without one gets raw text)."""

    def __init__(self, inner: Any, kind: EnvironmentKind, max_turns: int, workers: int, timeout_s: float,
                 max_env_tokens: int, tokenizer: Any, prompt_of: Callable[[int], Any],
                 chat_template: str | None = None, eval_prompts: Callable[[], list] = list, functions: Any = None,
                 max_prefix: int | None = None):
        self.inner, self.kind, self.max_turns, self.max_env_tokens = inner, kind, max_turns, max_env_tokens
        self.tokenizer, self.prompt_of, self.chat_template = tokenizer, prompt_of, chat_template
        self.eval_prompts = eval_prompts  # the prompts an evaluation may ask for (generate_greedy)
        self.chat = chat_template is not None or bool(getattr(tokenizer, "chat_template", None))
        self.max_prefix = max_prefix  # the longest prefix a next turn still fits the model's context after
        self.functions = functions  # the run's reward functions, added to the environment's reward (or None)
        self.host = EnvironmentHost(kind.cls, workers, timeout_s, functions=functions)
        self.groups: dict[int, Group] = {}
        self.failed: list[tuple[int, str]] = []
        self._dropped: list[tuple[int, int]] = []  # instances to forget (``_drop``)
        self.reached: dict[int, Group] = {}  # aborted groups, until ``abort_note`` words their abort
        self._ids = itertools.count(1 << 40)  # inner request ids: apart from group ids
        self._lock = threading.RLock()
        self.on_turn: Callable[..., None] = lambda gid, i, turn, version, done: None
        self.at_boundary: Callable[[int, int], bool] = lambda gid, turn: False
        self.on_failed: Callable[[int, str], None] = lambda gid, why: None
        FreeTurns.__init__(self)

    def bind(self, on_turn: Callable[..., None], at_boundary: Callable[[int, int], bool],
             on_failed: Callable[[int, str], None]) -> None:
        """The pump's callbacks, called on the polling thread outside this object's lock: a turn finished
        ``(gid, trajectory, turn, version, done)`` (done: the trajectory ended with it); is the group stopped after
        ``turn`` (True: the pump aborted it); a group failed for good ``(gid, why)``."""
        self.on_turn, self.at_boundary, self.on_failed = on_turn, at_boundary, on_failed

    # --- the GenerationBackend Protocol -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.inner.version

    def submit(self, requests: Sequence[GenerationRequest]) -> None:
        with self._lock:
            for r in requests:
                self.groups[r.group_id] = Group(r.group_id, r.n)

    def num_inflight(self) -> int:
        with self._lock:
            return len(self.groups)

    def abort(self, group_ids: Sequence[int]) -> list[int]:
        with self._lock:
            gone = [self.groups.pop(g) for g in group_ids if g in self.groups]
            self.reached.update({g.gid: g for g in gone})
        inner_ids = [r for g in gone for r in g.waiting]
        if inner_ids:
            self.inner.abort(inner_ids)
        self._drop(gone)
        return [g.gid for g in gone]

    def poll(self, timeout: float | None = 0.0) -> list[GroupRollouts]:
        """One turn of every trajectory in flight (module invariants); the groups all of whose trajectories ended
        (a running pump's poll, ``timeout`` > 0, with ``free_turns``: ``_poll_free``)."""
        if self.free_turns and timeout:
            return self._poll_free(timeout)
        settled = self._settle()  # what a running pump's polls left with the environment, before lockstep turns
        self._flush_drops()
        with self._lock:
            new = [g for g in self.groups.values() if not g.started]
        self._start(new)
        done = self.inner.poll(timeout) if self.inner.num_inflight() else []
        turned, events = self._take_turns(done)
        self._environment(turned)
        for gid, i, turn, version in events:  # after the environment: whether the trajectory ended is known
            g = next((g for g in turned if g.gid == gid), None)
            self.on_turn(gid, i, turn, version, g is None or g.trajectories[i].done or gid not in self.groups)
        with self._lock:  # (a group aborted meanwhile is no longer in ``groups``)
            finished = [g for g in turned if g.gid in self.groups and all(t.done for t in g.trajectories)
                        and not g.waiting]
        return settled + self._end_turns(turned, finished, [(g, None) for g in sorted(turned, key=lambda g: g.gid)])

    def _end_turns(self, turned: list[Group], finished: list[Group], going: list[tuple[Group, Any]]) -> list:
        """The end of a poll: score the ``finished`` groups, stop the other ``turned`` ones the sampler stops at
        this boundary, request the next turns of ``going`` (``(group, which trajectories)``, in order); the groups
        returned."""
        scored = self._score(finished)
        finished = [g for g in finished if g.gid in scored]
        stopped = [g for g in turned if g not in finished and g.gid in self.groups and self.at_boundary(g.gid, g.turn)]
        requests = []
        with self._lock:
            for g in stopped + finished:
                self.groups.pop(g.gid, None)
            for g, which in going:
                if g.gid in self.groups:
                    requests += self._next_turn(g, which)
        self._drop(stopped)
        out = [self._rollouts(g, *scored[g.gid]) for g in finished]
        self._drop(finished)
        if requests:
            self.inner.submit(requests)
        for gid, why in self.take_failed():
            self.on_failed(gid, why)
        return out

    def abort_note(self, gid: int) -> str:
        """What an ``abort`` trace row adds for a group this aborted: the turn its trajectories reached, and the
        versions their turns were generated at (once; "" for any other group)."""
        g = self.reached.pop(gid, None)
        if g is None:
            return ""
        versions = sorted({v for t in g.trajectories for v in t.turn_versions})
        return (f"; stopped at turn {g.turn} of at most {self.max_turns} (turns generated with weights "
                f"{versions or 'none yet'})")

    def take_failed(self) -> list[tuple[int, str]]:
        """The groups given up since the last call, with why (their instances are dropped)."""
        with self._lock:
            out, self.failed = self.failed, []
        return out

    def load_weights(self, weights, version: int) -> None:
        self.inner.load_weights(weights, version)

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | None = None) -> list[list[int]]:
        """Evaluation (``Controller.evaluate``): a greedy episode from each prompt, its row found among
        ``eval_prompts()`` by its token ids (in order, for prompts that read alike); returns each episode's tokens
        after the prompt, so the task grades the whole transcript. Draws no sampling randomness."""
        from asyncrl.chat import prompt_ids

        rows: dict[tuple, list] = {}
        for p in self.eval_prompts():
            rows.setdefault(tuple(prompt_ids(self.tokenizer, p)), []).append(p)
        taken: dict[tuple, int] = {}
        found = []
        for ids in prompts:
            same = rows.get(tuple(ids)) or [None]
            k = taken[tuple(ids)] = taken.get(tuple(ids), -1) + 1
            found.append(same[k % len(same)])
        if any(p is None for p in found):
            raise ValueError("an evaluation prompt of an environment run is not one of the task's prompts")
        episodes = [Group(-1 - i, 1, started=True) for i in range(len(found))]  # never the pump's to start
        calls = [((g.gid, 0), "make", (dict(p.columns or {}),)) for g, p in zip(episodes, found)]
        extras = [o.value if o.ok else None for o in self.host.run(calls)]
        for g, p, extra in zip(episodes, found, extras):
            g.chat = self._chat(p)
            text, messages = self._prompt(p, extra, g.chat)
            g.prompt_ids = self._encode(text, prompt=not g.chat)
            g.trajectories = [Trajectory(messages=messages, text=text)]
        live = episodes
        while live:
            turns = self.inner.generate_greedy([g.prompt_ids + g.trajectories[0].ids for g in live], max_new_tokens)
            for g, ids in zip(live, turns):
                t = g.trajectories[0]
                t.ids, t.mask = t.ids + list(ids), t.mask + [1] * len(ids)
                t.turn_versions.append(self.inner.version)
            with self._lock:
                self.groups.update({g.gid: g for g in live})  # _environment answers groups in flight only
            try:
                self._environment(live)  # an episode whose environment fails ends there (``_fail``)
            finally:
                with self._lock:
                    for g in live:
                        self.groups.pop(g.gid, None)
            live = [g for g in live if not g.trajectories[0].done]
        self.host.drop([(g.gid, 0) for g in episodes])
        return [g.trajectories[0].ids for g in episodes]

    def generate_sampled(self, *args, **kwargs) -> list:
        """Sampled evaluation plays no environment yet: one line, not single-turn answers graded as episodes."""
        raise ValueError("evaluate(temperature > 0) of a run with an environment is not supported yet; evaluate "
                         "greedy (temperature 0): one episode a prompt")

    def __getattr__(self, name: str) -> Any:  # generate_greedy, stage_weights, state_dict, ...: the inner's
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def close(self) -> None:
        self._flush_drops()
        self.host.close()
        self.inner.close()

    # --- turns --------------------------------------------------------------------------------------------------
    def _start(self, groups: list[Group]) -> None:
        """Make and reset each trajectory's environment; render the prompt; request every first turn."""
        prompts = {g.gid: self.prompt_of(g.gid) for g in groups}
        outcomes = iter(self.host.run(self._make_calls(groups, prompts)) if groups else [])
        self._begin([(g, prompts[g.gid], [next(outcomes) for _ in range(g.n)]) for g in groups])

    @staticmethod
    def _make_calls(groups: list[Group], prompts: dict) -> list[tuple]:
        return [((g.gid, i), "make", (dict(prompts[g.gid].columns or {}),)) for g in groups for i in range(g.n)]

    def _begin(self, made: list[tuple[Group, Any, list]]) -> None:
        """Each ``(group, prompt, its make outcomes)``: its prompt rendered, its first turn requested (one request
        for all its trajectories); a failed make gives the group up."""
        requests = []
        with self._lock:
            for g, prompt, results in made:
                if g.gid not in self.groups:
                    continue
                bad = next((o.problem for o in results if not o.ok), None)
                extra = {o.value for o in results if o.ok}
                if bad is None and len(extra) > 1:
                    bad = f"{self.kind.cls.__qualname__}.reset extended one prompt differently within its group"
                if bad is not None:
                    self._fail(g, bad)
                    continue
                g.chat = self._chat(prompt)
                text, messages = self._prompt(prompt, extra.pop(), g.chat)
                g.prompt_text, g.prompt_ids = text, self._encode(text, prompt=not g.chat)
                g.trajectories = [Trajectory(messages=[dict(m) for m in messages], text=text) for _ in range(g.n)]
                g.started = True
                rid = next(self._ids)
                g.waiting[rid] = list(range(g.n))
                requests.append(GenerationRequest(rid, g.prompt_ids, g.n))
        if requests:
            self.inner.submit(requests)

    def _chat(self, prompt: Any) -> bool:
        """Whether a group is a conversation (the chat template renders it): a conversational prompt, or any prompt
        of a tool environment; a standard prompt of a text environment, or a model without a template: raw text."""
        return self.chat and (prompt.messages is not None or self.kind.kind == "tool")

    def _prompt(self, prompt: Any, extra: str | None, chat: bool) -> tuple[str, list[dict]]:
        """The prompt's text as the model sees it (extended by ``reset``'s string) and its messages."""
        if not chat:
            return prompt.text + (extra or ""), []
        messages = [dict(m) for m in (prompt.messages or [{"role": "user", "content": prompt.text}])]
        if extra:
            messages[-1]["content"] = f"{messages[-1]['content']}\n\n{extra}"
        return self._render(messages), messages

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=list(self.kind.tools) or None, tokenize=False,
                                                  add_generation_prompt=True, chat_template=self.chat_template)

    def _decode(self, ids: Sequence[int]) -> str:
        """Token ids as text, special tokens kept (what ``completion`` holds: the tokens exactly)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _encode(self, text: str, prompt: bool = False) -> list[int]:
        """Ids of ``text``: a raw prompt with ``<bos>`` (``asyncrl.chat.prompt_ids``), anything else without."""
        return list(self.tokenizer.encode(text) if prompt else self.tokenizer.encode(text, add_special_tokens=False))

    def _take_turns(self, done: list[GroupRollouts]) -> tuple[list[Group], list[tuple[int, int, int, int]]]:
        """Append the turns the generator returned to their trajectories."""
        turned, events = [], []
        with self._lock:
            owner = {rid: g for g in self.groups.values() for rid in g.waiting}
            for out in done:
                g = owner.get(out.group_id)
                if g is None:
                    continue  # its group was aborted
                for i, ids, lps in zip(g.waiting.pop(out.group_id), out.completion_ids, out.logprobs):
                    t = g.trajectories[i]
                    t.ids += ids
                    t.mask += [1] * len(ids)
                    t.logprobs += lps
                    t.versions += [out.gen_start_version] * len(ids)
                    t.turn_versions.append(out.gen_start_version)
                    t.turn_texts.append({"role": "assistant", "text": self._decode(ids),
                                         "version": out.gen_start_version})
                    t.finish = out.finish_reasons[0] if out.finish_reasons else ""
                    events.append((g.gid, i, len(t.turn_versions), out.gen_start_version))
                g.turn = max(len(t.turn_versions) for t in g.trajectories)
                if not g.waiting and g not in turned:
                    turned.append(g)
        return turned, events

    def _environment(self, groups: list[Group]) -> None:
        """The environment's reply to every trajectory's latest turn (one batch of calls for all of them)."""
        calls, where = self._env_calls([(g, i) for g in groups for i, t in enumerate(g.trajectories) if not t.done])
        outcomes, replies = iter(self.host.run([c for c in calls if c[1] != "drop?"])), {}
        for call, (g, i, name) in zip(calls, where):
            replies.setdefault((g.gid, i), []).append((g, name, next(outcomes) if call[1] != "drop?" else None))
        self._replies(replies)

    def _env_calls(self, trajectories: list[tuple[Group, int]]) -> tuple[list[tuple], list[tuple]]:
        """The calls answering each trajectory's latest turn, ``(key, op, args)`` (``drop?``: a malformed tool call,
        answered by its parse error), each with ``(group, trajectory, tool name)``; a tool trajectory whose turn
        called no tool (or reached ``max_turns``) ends here, with none."""
        calls, where = [], []
        for g, i in trajectories:
            t = g.trajectories[i]
            action = self._turn_text(t)
            if self.kind.kind == "text":
                calls.append(((g.gid, i), "step", (action,)))
                where.append((g, i, None))
                continue
            parsed = parse_tool_calls(action)
            if not parsed or len(t.turn_versions) >= self.max_turns:
                t.done = True
                if g.chat:  # the conversation ends with the model's last turn
                    t.messages.append({"role": "assistant", "content": action})
                continue
            for call in parsed:
                if isinstance(call, str):
                    calls.append(((g.gid, i), "drop?", ()))
                    where.append((g, i, call))
                else:
                    calls.append(((g.gid, i), "tool", call))
                    where.append((g, i, call[0]))
        return calls, where

    def _replies(self, replies: dict[tuple[int, int], list]) -> None:
        """Apply each trajectory's answers ``[(group, tool name, outcome or None)]``: a failed one gives its group
        up, the rest are observed (groups no longer in flight are left alone)."""
        with self._lock:
            for (gid, i), answers in replies.items():
                g = answers[0][0]
                if gid not in self.groups or any(o is not None and not o.ok for _, _, o in answers):
                    bad = next((o.problem for _, _, o in answers if o is not None and not o.ok), None)
                    if gid in self.groups and bad is not None:
                        self._fail(g, bad)
                    continue
                self._observe(g, g.trajectories[i], answers)

    def _turn_text(self, t: Trajectory) -> str:
        """The latest model turn's text (without the end-of-turn token: the template writes its own)."""
        ids = t.ids[len(t.ids) - self._last_turn_length(t):]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if ids and ids[-1] == eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _observe(self, g: Group, t: Trajectory, answers: list) -> None:
        """Append the environment's reply (a text environment's observation, or the tool results) as context."""
        action = self._turn_text(t)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ended = bool(t.ids) and t.ids[-1] == eos  # the turn's end-of-turn token: held, whatever the template writes
        t.text += action
        if g.chat:
            t.messages.append({"role": "assistant", "content": action})
        if self.kind.kind == "text":
            obs, reward, done = answers[0][2].value
            t.reward += reward
            if done or obs is None or len(t.turn_versions) >= self.max_turns:
                t.done = True
                if g.gid < 0 and obs is not None and not g.chat:  # an evaluation's transcript ends with the last
                    t.ids += self._encode(obs)[:self.max_env_tokens]  # reply (``correct``): the task grades it
                return
            if g.chat:  # its content cut to max_env_tokens, then rendered (the rendering is never cut)
                (content,) = cut_contents(self.tokenizer, [obs], self.max_env_tokens)
                t.messages.append({"role": "user", "content": content})
        else:
            t.tool_calls += len(answers)  # every call the model wrote, answered or refused (TRL's tool_call_count)
            contents = cut_contents(self.tokenizer, [o.value if o is not None else name for _, name, o in answers],
                                    self.max_env_tokens)  # a malformed call's content: its parse error
            for (_, name, o), content in zip(answers, contents):
                t.messages.append({"role": "tool", "name": name if o is not None else "error", "content": content})
        if g.chat:
            rendered = self._render(t.messages)
            end = self.tokenizer.decode([eos], skip_special_tokens=False) if ended else ""
            if end and rendered.startswith(t.text + end):  # the template ends a turn with that token (Qwen's)
                t.text += end
            if not rendered.startswith(t.text):
                self._fail(g, "the chat template re-renders earlier turns differently (the conversation's rendering "
                           "does not start with the tokens already held), so the trajectory's tokens would drift")
                return
            obs = rendered[len(t.text):]
        ids = self._encode(obs)
        if not g.chat and len(ids) > self.max_env_tokens:  # raw text: all content, cut in tokens
            ids = ids[:self.max_env_tokens]
            obs = self._decode(ids)
        t.text += obs
        t.ids += ids
        t.mask += [0] * len(ids)
        t.logprobs += [0.0] * len(ids)
        t.env_tokens += len(ids)
        t.turn_texts.append({"role": "user" if self.kind.kind == "text" else "tool", "text": self._decode(ids),
                             "version": None})
        if self.max_prefix is not None and len(g.prompt_ids) + len(t.ids) > self.max_prefix:
            t.done, t.finish = True, "length"  # no room for another turn in the model's context: it ends here

    @staticmethod
    def _last_turn_length(t: Trajectory) -> int:  # the sampled tokens at the end
        return next((n for n, m in enumerate(reversed(t.mask)) if m == 0), len(t.mask))

    def _next_turn(self, g: Group, which: Any = None) -> list[GenerationRequest]:
        """One request per live trajectory (of ``which``; None: all), its whole token prefix, in trajectory order."""
        out = []
        for i, t in enumerate(g.trajectories):
            if not t.done and (which is None or i in which):
                rid = next(self._ids)
                g.waiting[rid] = [i]
                out.append(GenerationRequest(rid, g.prompt_ids + t.ids, 1))
        return out

    def _fail(self, g: Group, why: str) -> None:
        """Give the group up (under ``_lock``): the pump regenerates or skips it. An evaluation episode (a negative
        id) just ends, unrewarded."""
        if g.gid < 0:
            for t in g.trajectories:
                t.done, t.finish = True, "error"
            return
        if self.groups.pop(g.gid, None) is not None:
            self.failed.append((g.gid, why))
            stale = list(g.waiting)
            g.waiting.clear()
            if stale:
                self.inner.abort(stale)
            self._drop([g])

    def _drop(self, groups: list[Group]) -> None:
        """Forget the groups' instances at the next poll, on the polling thread (an abort, from the train pump's
        thread under the run's lock, never waits for an environment call)."""
        with self._lock:
            self._dropped += [(g.gid, i) for g in groups for i in range(g.n)]

    def _flush_drops(self, wait: bool = True) -> None:
        with self._lock:
            keys, self._dropped = self._dropped, []
        if keys:
            self.host.drop(keys, wait)

    @property
    def reward_names(self) -> list[str]:
        """The parts of a trajectory's reward (``reward/<name>``): the environment's, then each function's."""
        return [ENVIRONMENT_REWARD, *(self.functions.names if self.functions is not None else [])]

    def _score(self, groups: list[Group]) -> dict[int, tuple[list[float], dict[str, list]]]:
        """Each finished group's rewards: the environment's (``get_reward``, or the sum of ``step``'s), plus the
        run's reward functions (weighted), which get ``environments=`` and the conversation; and the parts
        (``reward_names``: the environment's, each function's values). A failure gives the group up (``_fail``);
        the groups scored are returned."""
        out: dict[int, tuple[list[float], dict[str, list]]] = {}
        for g in groups:
            extra, parts = [0.0] * g.n, {}
            if self.kind.kind == "tool":
                got = self.host.run([((g.gid, i), "reward", ()) for i in range(g.n)])
                bad = next((o.problem for o in got if not o.ok), None)
                if bad is None:
                    for t, o in zip(g.trajectories, got):
                        t.reward = o.value
            else:
                bad = None
            if bad is None and self.functions is not None:
                batch = reward_batch(self.prompt_of(g.gid), g, self.tokenizer)
                (o,) = self.host.run([((g.gid, 0), "score", ([(g.gid, i) for i in range(g.n)], batch))])
                results = o.value if o.ok else []
                bad = o.problem if not o.ok else next((why for kind, why, _ in results if kind != "ok"), None)
                if bad is None:
                    extra = self.functions.combine([values for _, values, _ in results])
                    parts = self.functions.parts([values for _, values, _ in results])
            if bad is not None:
                with self._lock:
                    self._fail(g, bad)
                continue
            out[g.gid] = ([t.reward + x for t, x in zip(g.trajectories, extra)],
                          {ENVIRONMENT_REWARD: [t.reward for t in g.trajectories], **parts})
        return out

    def _rollouts(self, g: Group, rewards: list[float], parts: dict[str, list]) -> GroupRollouts:
        """The finished group as the pump commits it (rewards and their parts: ``_score``'s)."""
        ts = g.trajectories
        versions = [v for t in ts for v in t.turn_versions]
        return GroupRollouts(
            group_id=g.gid, prompt_ids=g.prompt_ids, completion_ids=[t.ids for t in ts],
            logprobs=[t.logprobs for t in ts], gen_start_version=min(versions), gen_end_version=max(versions),
            finish_reasons=[t.finish for t in ts], rewards=list(rewards),
            texts=[self._decode(t.ids) for t in ts], prompt_text=g.prompt_text,
            token_versions=[t.versions for t in ts], trained_mask=[t.mask for t in ts], reward_parts=parts,
            turns=[{"turns": len(t.turn_versions), "tool_calls": t.tool_calls, "env_tokens": t.env_tokens,
                    "turn_versions": list(t.turn_versions), "turn_texts": [dict(x) for x in t.turn_texts]} for t in ts])
