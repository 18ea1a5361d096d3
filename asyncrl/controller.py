"""The single controller: a rollout pump and a train pump around one replay buffer, following one sampler.

The controller wires the parts and drives them; each pump reads top to bottom in its own file: ``rollout_tick``
calls the rollout pump (``asyncrl/rollout.py``: admit, dispatch, poll, score, retry, skip, commit), ``train_tick``
the train pump (``asyncrl/train.py``: evict, select, logprobs, advantages, train, and at the end of a step:
optimizer step, ``T += 1``, weight sync, abort). ``start``/``run`` drive the same two ticks from two threads so
generation overlaps training (``asyncrl.run_loop``). The run state (``T``, trace, metrics, ...) is one ``RunState``
(``asyncrl/state.py``) that this controller owns and hands to its pumps; observers ``subscribe`` to its events.
Checkpoints are data: ``save`` hands ``(config, state_dict())`` to ``asyncrl/checkpoint.py``, ``restore`` builds a
controller from the ``(config, state_dict)`` it reads back.

Invariants:
- The pumps never encode a policy: every admit/select/evict/abort decision is the sampler's.
- Every admitted group is, exactly once, trained (``select``), evicted, aborted or skipped (given up after a fault,
  ``RolloutPump.skip`` is the only way), and the trace says which and why. Every error caught is a ``fault`` event
  (``asyncrl/faults.py`` describes the budgets, retries and replacements).
- Permits: ``len(buffer) <= buffer.capacity`` (the one capacity: the config's, or what the sampler needs; a batch is
  dispatched only when all its groups fit) and in-flight groups (the buffer's pending slots) never exceed
  ``max_inflight_groups``.
- ``T`` and the generator's version move together under the lock: the rollout pump never sees ``T + 1`` while
  the generator still holds weights ``T``. That is what makes ``in_order`` with no lookahead synchronous GRPO.
  (A generator that stages weights — vLLM behind the collective sync — reports the staged version as soon as the
  receive completed, before the sync returns, and swaps them in between two engine steps (``weight_update``: drain
  or inflight). Groups carry the versions they were really generated with.)
- With a gated sampler the schedule does not depend on timing, stepped or threaded: the train pump admits the
  batches due at the old ``T`` before the sync, and a generator generates what was submitted before a weight load.
- A checkpoint holds no group in flight (``RolloutPump.settle``; past ``stall_timeout_s`` one is sent again), so a
  resume is exact whatever the save caught and a slot's version stays true. Waiting, not regenerating: the torch
  generator draws all groups from one stream in submission order, and no checkpoint holds older weights.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from asyncrl import metrics as M
from asyncrl.algorithms import Loss
from asyncrl.buffer import ReplayBuffer
from asyncrl.config import Config, check_sampler_fits, warn_toy_knobs
from asyncrl.faults import FaultContainment
from asyncrl.parts import FixedParts
from asyncrl.reports import ControllerState, TickReport
from asyncrl.restoring import GIVEN, check_on_sampler_change as _check_on_sampler_change, rejudge
from asyncrl.rollout import RolloutPump
from asyncrl.multiturn import TurnsView, attach, with_environment
from asyncrl.run_loop import ActiveClock, RunHandle, runs_in_lockstep
from asyncrl.samplers import build_sampler
from asyncrl.state import RunState, Subscription
from asyncrl.train import TrainPump
from asyncrl.trace import (  # noqa: F401  (all importable from here too)
    ABORT, EVICT, SELECT, STEP, SYNC, TRACE_COLUMNS, TRACE_DTYPES, TRACE_EVENTS, TRAIN, StepEvent, TraceRow,
)
from asyncrl.tracking import Tracker


def _tick(method):
    """A tick by hand is refused while a run's pumps go (pause the run first), its time is active time for the
    step timer, and its events go to the subscribers when it ends."""

    @functools.wraps(method)
    def tick(self, *args, **kwargs):
        if self._run is not None:
            self._run.check_hand_tick()
        try:
            with self.clock:
                return method(self, *args, **kwargs)
        finally:
            self._state.deliver()  # subscribers hear of the tick's events after it, outside the lock

    return tick


class Controller(FixedParts, TurnsView):  # policy, generator, task, sampler, buffer: fixed at construction
    def __init__(self, cfg: Config, task, policy, generator, tokenizer, sampler=None, buffer=None,
                 reward_funcs=None, environment_factory=None):
        from asyncrl.chat import prepare_task
        from asyncrl.tasks import PromptStream, check_rewards
        self.task = task = prepare_task(task, tokenizer, cfg.model, cfg.generation.max_new_tokens)  # as rendered
        self.reward_funcs = list(reward_funcs or [])  # reward functions given as objects (in place of reward.funcs)
        self.given: list[str] = []  # from_config's arguments given as objects: what a restore must be given again
        generator, cfg = with_environment(cfg, generator, tokenizer, environment_factory, lambda g: self.buffer[g],
                                          task, self.reward_funcs)
        self.reward_functions = check_rewards(task, cfg.reward, self.reward_funcs,  # columns checked against the rows
                                              cfg.generation.backend == "simulated" or bool(cfg.environment.factory))
        from asyncrl.backends import place_reward_models
        place_reward_models(cfg, self.reward_functions)  # a GPU run's reward models score on its GPU, under its lock
        if cfg.eval_every and not task.eval_prompts:
            raise ValueError(f"eval_every {cfg.eval_every}: task {task.name!r} has no evaluation split; give it one "
                             "(task.options.eval or eval_fraction, or eval_dataset=) or set eval_every null")
        if reward_funcs:  # named in the config a run writes (config.yaml, checkpoints)
            cfg = cfg.model_copy(update={"reward": cfg.reward.with_funcs(reward_funcs)})
        self.cfg = cfg
        self.policy = policy
        self.generator = generator
        self.tokenizer = tokenizer
        self.buffer = buffer if buffer is not None else ReplayBuffer()
        if sampler is not None:  # built by hand: asked what the configuration asked of cfg.sampler's class
            check_sampler_fits(sampler, cfg)
        # The run's one sampler: loading the config asked its class and knobs, and built none.
        self.sampler = sampler if sampler is not None else build_sampler(cfg.sampler, self.buffer)
        if not task.train_prompts:
            raise ValueError(f"task {task.name!r} has no training prompts; a run needs at least one")
        self.buffer.capacity = cfg.buffer_capacity(self.sampler.required_buffer_capacity(cfg.groups_per_step))
        self.stream = PromptStream(task.train_prompts, seed=cfg.seed, max_epochs=cfg.max_epochs)
        self._state = RunState()  # T, trace, metrics, ...: written only by this controller's pumps
        self._lock = self._state.lock
        self.faults = FaultContainment(cfg.faults, _backend_name(cfg.generation), _backend_name(cfg.trainer))
        self.last_report: TickReport | None = None
        self.tracker = Tracker(cfg.tracking, cfg.model_dump(mode="json"))  # does nothing unless configured
        if self.tracker.active:  # a sink like any other observer: each step's metrics row
            self.subscribe(lambda event: self.tracker.log(event.metrics), events=STEP)
        self._frames: dict[str, tuple[int, pd.DataFrame]] = {}
        self._prompt_ids: dict[str, list[int]] = {}
        self._run: RunHandle | None = None  # the latest run (start/run); at most one goes at a time
        self.clock = ActiveClock()  # time inside ticks or while a run goes: what the step timer counts
        from asyncrl.backends.weight_sync import build_weight_sync

        self.sync_weights = build_weight_sync(cfg, policy, generator)  # generation.weight_sync: driver | collective
        self._rollout = RolloutPump(cfg, self._state, self.buffer, self.sampler, self.stream, generator, task,
                                    tokenizer, self.encode, self.sync_weights, self.faults, self.reward_functions)
        self._train = TrainPump(cfg, self._state, self.buffer, self.sampler, policy, generator, task, tokenizer,
                                self._rollout, self.faults, self.clock.now, self._save_periodic,
                                self.reward_functions)
        attach(self._rollout, generator, self._train)
        self.sync_weights(0)

    def encode(self, prompt) -> list[int]:
        """A prompt's token ids (a conversational one's are its chat template's: ``asyncrl/chat.py``), cached per
        controller: prompts repeat every epoch, and encoding is slow next to a lookup."""
        from asyncrl.chat import prompt_ids

        key = (prompt, True) if isinstance(prompt, str) else (prompt.text, prompt.messages is None)
        ids = self._prompt_ids.get(key)
        if ids is None:
            ids = self._prompt_ids[key] = prompt_ids(self.tokenizer, prompt)
        return ids

    @classmethod
    def from_config(cls, cfg: Config, loss: Loss | None = None, train_dataset: Any = None, eval_dataset: Any = None,
                    reward_funcs: list | None = None, reward_weights: list[float] | None = None,
                    reward_processing_classes: list | None = None, environment_factory: type | None = None,
                    ) -> Controller:
        """Task, backends and sampler from ``cfg``; the policy trains with ``loss`` (default ``GRPOLoss(cfg.loss)``:
        a loss of your own is one class satisfying ``asyncrl.algorithms.Loss``). ``train_dataset`` /
        ``eval_dataset`` (a ``datasets.Dataset``, a DataFrame, a list of dicts, or a path) make the task a ``dataset``
        task over them; ``reward_funcs``, ``reward_weights``, ``reward_processing_classes`` are TRL's (functions or
        reward models, docs/tasks.md); ``environment_factory``: a class, one instance a trajectory (multi-turn,
        docs/environments.md). Objects given are named in checkpoints: ``restore`` asks for them again."""
        from asyncrl.backends import build_backends
        from asyncrl.rewards.models import with_tokenizers
        from asyncrl.tasks import task_with_data

        reward_funcs = with_tokenizers(reward_funcs, reward_processing_classes)
        if reward_weights is not None:  # checked against the functions when the controller is built
            cfg = cfg.model_copy(update={"reward": cfg.reward.with_funcs([], reward_weights)})
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        torch.manual_seed(cfg.seed)
        task = task_with_data(cfg.task, train_dataset, eval_dataset)
        warn_toy_knobs(cfg, objects=train_dataset is not None)  # (a config's own data warned when it loaded)
        policy, generator, tokenizer = build_backends(cfg, loss)
        ctrl = cls(cfg, task, policy, generator, tokenizer, reward_funcs=reward_funcs,
                   environment_factory=environment_factory)
        given = (train_dataset, eval_dataset, reward_funcs, environment_factory)
        ctrl.given = [k for k, v in zip(GIVEN, given) if v is not None]
        return ctrl

    # ------------------------------------------------------------------------------------------ rollout pump
    @_tick
    def rollout_tick(self, wait_s: float = 0.0) -> TickReport:
        """Ask ``admit``; dispatch at most one batch; collect what finished; score; commit (``asyncrl/rollout.py``).
        ``wait_s``: how long ``poll`` may wait for a group in flight to finish (a run's pump waits a little rather
        than spin)."""
        report = self._rollout.tick(wait_s)
        self.last_report = report
        return report

    # -------------------------------------------------------------------------------------------- train pump
    @_tick
    def train_tick(self) -> TickReport:
        """Evict; select a chunk; train on it; when the step's groups are all trained, finish the step
        (``asyncrl/train.py``)."""
        report = self._train.tick()
        self.last_report = report
        return report

    def tick(self) -> TickReport:
        """One rollout tick, then one train tick."""
        report = self.rollout_tick().merge(self.train_tick())
        self.last_report = report
        return report

    # ------------------------------------------------------------------------------------------------ running
    def start(self, steps: int, until=None, progress: bool = True, on_step=None, max_time_s=None) -> RunHandle:
        """Run both pumps in the background until ``T`` has grown by ``steps`` (or the data ran out, or ``until``
        matched); returns a ``RunHandle`` at once (``pause``, ``resume``, ``stop``, ``wait``, ``running``,
        ``error``). ``until``: a trace event name (``TRACE_EVENTS``) or a callable on a trace row: the run stops
        right after the tick that emitted the first match among this run's events. ``on_step(row, events)`` is
        called in the train pump after each step with its metrics row and the trace rows (``TraceRow``) since the
        last call. With a sampler that cannot admit ahead (``lockstep``) one thread runs both ticks in turn.
        ``max_time_s``: a wall-time limit (default ``cfg.max_time_s``; status ``time_limit``: asyncrl/run_loop.py)."""
        if self._run is not None and self._run.alive:
            raise RuntimeError(f"a run is already going ({self._run!r}): wait for it, or stop it, before starting "
                               "another")
        handle = RunHandle(self, steps, until, progress, on_step, max_time_s, self._save_periodic)  # validates first
        self._run = handle
        self._train.measure_beside(lambda: handle.running)  # the gap pass's thread, for the run's length
        handle._launch()
        return handle

    def run(self, steps: int, until=None, progress: bool = True, max_time_s: float | None = None) -> pd.DataFrame:
        """``start(steps, until).wait()``: blocks; an interrupt (Ctrl-C, a notebook's Interrupt) stops both pumps
        at a safe point and is re-raised, and an error in either pump is re-raised as the original exception; the
        controller stays steppable. Returns the metrics of the steps it ran; ``.attrs["status"]`` says how it ended
        (completed, exhausted, breakpoint, ...), ``.attrs["breakpoint"]`` the trace row ``until`` matched and
        ``.attrs["until_fired"]`` whether it matched (None without ``until``); a run that ended without its
        breakpoint also warns (``UserWarning``). ``max_time_s``: a wall-time limit (``start``)."""
        return self.start(steps, until, progress, max_time_s=max_time_s).wait()

    async def arun(self, steps: int, until=None, progress: bool = True) -> pd.DataFrame:
        """``run`` without blocking the event loop (a notebook stays responsive); cancelling it stops the run."""
        handle = self.start(steps, until, progress)
        try:
            await asyncio.to_thread(handle._finished.wait)
        except asyncio.CancelledError:
            handle.stop()
            raise
        return handle.wait()

    def drain(self) -> None:
        """Collect what finished after a run's pumps stopped, so nothing is left half-accounted."""
        try:
            self._rollout.drain()
        finally:
            self._state.deliver()

    # ---------------------------------------------------------------------------------------------- observing
    def subscribe(self, callback, events=None, history: bool = False) -> Subscription:
        """Call ``callback(event)`` for each trace event from now on (``events``: names from ``TRACE_EVENTS``;
        default all). ``event`` is a ``TraceRow`` (the trace's columns: ``seq``, ``event``, ``trainer_version``,
        ``group_id``, ``weight_version``, ``target_step``, ``lag``, ``detail``, ``reason``), except for ``step``: a
        ``StepEvent`` with the step's ``row`` and its ``metrics`` row. Events come in trace order, each once, at the
        end of the tick that recorded them, outside the controller's lock, in the thread that ran the tick (a run's
        pump). ``history=True`` first replays every event so far. Returns a ``Subscription`` (``cancel()``)."""
        return self._state.subscribe(callback, events, history)

    @property
    def num_events(self) -> int:
        """Rows in the trace so far (cheap: no frame is built)."""
        return len(self._state.trace)

    @property
    def changed(self) -> threading.Condition:
        """Notified when a pump made progress the other may wait for (a commit, a select, a step). Holding it holds
        the controller's lock: a driver checks ``num_events`` and waits under it, so no wake-up is lost."""
        return self._state.changed

    @property
    def lockstep(self) -> bool:
        """A run drives both ticks on one thread (``run_loop.runs_in_lockstep``: the sampler cannot admit ahead, or
        both engines share one GPU, or ``pump_threads`` 1); ticks do the same work either way."""
        return runs_in_lockstep(self.cfg, self.sampler.admits_ahead)

    @property
    def trainer_version(self) -> int:
        """``T``: optimizer steps done; the generator holds weights ``T``."""
        return self._state.trainer_version

    @property
    def data_position(self) -> int:
        """Prompts taken from the prompt stream so far."""
        return self._state.data_position

    @property
    def exhausted(self) -> bool:
        """The prompt stream has no batch left (set it to False to let a stepped test dispatch again)."""
        return self._state.exhausted

    @exhausted.setter
    def exhausted(self, value: bool) -> None:
        with self._lock:
            self._state.exhausted = bool(value)

    @property
    def inflight(self) -> dict[int, int]:
        """Groups dispatched and not yet back (the buffer's pending slots): group id -> weight version at dispatch,
        in dispatch order. A new dict each time: editing it changes nothing."""
        with self._lock:
            return {slot.group_id: slot.weight_version for slot in self.buffer.pending_slots()}

    @property
    def capacity(self) -> int:
        """How many groups the buffer may hold (``buffer.capacity``: ``max_buffered_groups``, else what the sampler
        needs to never deadlock)."""
        return self.buffer.capacity

    def _frame(self, name: str, rows: list, columns=None, dtypes=None) -> pd.DataFrame:
        cached = self._frames.get(name)
        if cached is None or cached[0] != len(rows):
            frame = pd.DataFrame(list(rows), columns=columns)
            cached = (len(rows), frame if dtypes is None else frame.astype(dtypes))
            self._frames[name] = cached
        return cached[1]

    @property
    def trace(self) -> pd.DataFrame:
        """Every admit/refuse/dispatch/commit/evict/select/train/sync/abort/step event, in order, with its reason.
        Ids, versions, steps and lags are nullable integers (``Int64``): an event without one has ``<NA>``."""
        with self._lock:
            return self._frame("trace", self._state.trace, TRACE_COLUMNS, TRACE_DTYPES)

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per optimizer step."""
        with self._lock:
            return self._frame("metrics", self._state.metrics)

    @property
    def completions(self) -> pd.DataFrame:
        """What the model wrote: a row per completion of each committed group, its rewards (asyncrl/completions.py)."""
        return self._rollout.scorer.log.frame()

    def completions_count(self, group_id: int) -> int:
        return self._rollout.scorer.log.count(group_id)

    def log_completions_to(self, path: str | Path) -> None:
        """Write the completions log to ``path`` (``completions.jsonl``; ``asyncrl run`` does) from now on."""
        with self._lock:
            self._rollout.scorer.log.open(path)

    @property
    def last_run(self) -> RunHandle | None:
        """The handle of the latest ``start``/``run`` (its ``status``, ``error``, ``breakpoint``), or None."""
        return self._run

    @property
    def generation_version(self) -> int:
        return self.generator.version

    def explain(self, timeout: float | None = None) -> pd.DataFrame:
        """The sampler's verdict for every buffered group as the next train tick would see it (with this step's
        chunk bounds), as a table; with generation replicas, also which replica generated each group. Changes
        nothing. ``timeout``: give up (``TimeoutError``) when a pump holds the lock longer than that."""
        from asyncrl import read_view

        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"explain: a pump held the controller's lock for over {timeout:g} s")
        try:
            return read_view.verdicts(self.cfg, self.sampler, self.buffer, self.trainer_version,
                                      self._train.step.groups, self._rollout.scorer.log.count)
        finally:
            self._lock.release()

    def state(self) -> ControllerState:
        """A consistent snapshot for widgets (versions, the buffer by version, the window, the last report).
        The verdicts are not in it: they cost a pass over the buffer, so ``explain()`` computes them when asked."""
        from asyncrl import read_view

        with self._lock:
            return read_view.snapshot(
                cfg=self.cfg, sampler=self.sampler, buffer=self.buffer, trainer_version=self.trainer_version,
                generation_version=self.generator.version, capacity=self.capacity, inflight=len(self.inflight),
                step_groups_trained=self._train.step.groups, data_position=self.data_position,
                exhausted=self.exhausted, last_report=self.last_report)

    @property
    def evaluations(self) -> pd.DataFrame:
        """Every held-out evaluation so far (by ``evaluate()``: ``eval_every``, the untrained model's before step
        0 when ``eval_every`` is set, and any call of yours), with the weight version it judged."""
        with self._lock:
            return self._frame("evaluations", self._state.evaluations, M.evaluation_columns(self._state.evaluations))

    def evaluate(self, split: str = "eval", n: int = 1, temperature: float = 0.0,
                 max_prompts: int | None = None) -> dict[str, float]:
        """``n`` completions of each prompt of ``split`` (its first ``max_prompts``), greedy (``temperature`` 0.0) or
        sampled, scored by the run's reward functions: ``mean@n``, ``pass@n``, ``reward_mean``, ``accuracy``, ``n``
        (prompts evaluated); a row of ``evaluations`` with its weight version (``asyncrl/evaluation.py``)."""
        return self._train.evaluate(split, n, temperature, max_prompts)

    # ------------------------------------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Write a checkpoint directory at ``path`` atomically: ``(config, state_dict())``, in the file layout
        ``asyncrl/checkpoint.py`` documents with what a resume restores; groups in flight are brought back first
        (``state_dict``)."""
        from asyncrl import checkpoint

        with self._lock:  # nothing moves while the files are written
            return checkpoint.save(path, self.cfg, self.state_dict())

    def _save_periodic(self) -> Path:
        """``checkpoint_every``: ``checkpoint_dir/step-XXXXXX``, keeping the newest ``keep_checkpoints``."""
        from asyncrl import checkpoint

        with self._lock:
            return checkpoint.save_periodic(self.cfg.checkpoint_dir, self.cfg, self.state_dict(),
                                            self.cfg.keep_checkpoints)

    def save_pretrained(self, path: str | Path) -> Path | None:
        """Write the trained policy as a Hugging Face model directory that transformers and vLLM load (config,
        safetensors, tokenizer, chat template): ``asyncrl.backends.hf.export_pretrained``."""
        from asyncrl.backends.hf import export_pretrained

        with self._lock:
            return export_pretrained(self.policy, self.cfg.model, self.tokenizer, path)

    def state_dict(self) -> dict:
        """Everything a resume needs, between two steps (``asyncrl/checkpoint.py`` says where each key is stored):
        the run state, ``in_step``, ``buffer``, ``sampler``, ``dispatch_index``, ``policy``, ``generator``,
        ``torch_rng``. First it brings back every group in flight (``RolloutPump.settle``: the module's invariants)."""
        with self._lock:
            step = self._train.step
            if step.started:
                raise RuntimeError(f"cannot save in the middle of step {self.trainer_version}: {step.groups} "
                                   f"of {self.cfg.groups_per_step} groups trained; save between steps")
            self._rollout.settle()  # every group in flight back first: a checkpoint holds none (rollout.py)
            # The capacity is the restoring config's (its sampler may differ): the key stays, empty, as ever.
            return {**self._state.state_dict(), "buffer": {**self.buffer.state_dict(), "capacity": None},
                    "in_step": {"train": self._train.step_state(), "gen": self._rollout.step_state(),
                                "versions": self._train.version_state()},
                    "sampler": self.cfg.sampler.model_dump(mode="json"), "dispatch_index": self.sampler.dispatch_index,
                    "policy": self.policy.state_dict(), "generator": self.generator.state_dict(),
                    "torch_rng": torch.get_rng_state(), "data": getattr(self.task, "identity", None), "given": self.given}

    def load_state_dict(self, state: dict, on_sampler_change: str = "rejudge") -> None:
        """Continue from ``state`` (``state_dict()``'s keys; ``buffer`` slots holding ``Prompt`` and
        ``GroupRollouts``): weights, optimizer, generator, RNG, buffer, history; the buffer's pending groups are
        submitted again. When ``state["sampler"]`` is not this controller's sampler, ``on_sampler_change`` says what
        happens to the restored groups (``restore`` documents it)."""
        _check_on_sampler_change(on_sampler_change)
        with self._lock:
            self.policy.load_state_dict(state["policy"])
            self.buffer.load_state_dict(state["buffer"])  # in place (the sampler judges this buffer), our capacity
            self._state.load_state_dict(state)
            self._frames.clear()
            T = self.trainer_version
            self.sync_weights(T)
            if state["generator"] is not None:
                self.generator.load_state_dict(state["generator"])
            torch.set_rng_state(state["torch_rng"])
            self._train.resume(state.get("in_step"))
            self._rollout.resume(state.get("in_step"), self._state.trace)  # in flight at save time: sent again
            self.sampler.set_dispatch_index(T)
            if state["sampler"] == self.cfg.sampler.model_dump(mode="json"):
                self.sampler.dispatch_index = state["dispatch_index"]  # exact, including batches admitted ahead of T
            else:
                rejudge(self.buffer, self.sampler, self._rollout, self._state, self.cfg, state["sampler"],
                        on_sampler_change)
            self._rollout.flush_unsent()

    @classmethod
    def restore(cls, path: str | Path, sampler: Any = None, config: Config | None = None,
                on_sampler_change: str = "rejudge", trust_code: bool = False, tracking: bool = False,
                **data: Any) -> Controller:
        """A controller that continues from the checkpoint at ``path`` (a checkpoint, or a directory of them: the
        newest intact one), built from ``config`` (default: the checkpoint's own, with no tracking sink unless
        ``tracking``) of the checkpoint's model shape; ``sampler`` replaces its sampler; ``trust_code``: what a
        restore without a config may import, and where it connects (asyncrl/checkpoint.py). Under another
        sampler, ``on_sampler_change="rejudge"`` skips the restored groups it can never train (no ``target_step``
        under a stamping sampler) or past its capacity (newest first) and runs its ``evict``; ``"drop"`` skips them
        all; the trace records each. ``data``: ``from_config``'s objects (reward functions replace those named:
        none is imported), which a run built from them must be given again (``asyncrl/restoring.py``)."""
        from asyncrl import checkpoint
        from asyncrl.restoring import check_given, untracked

        _check_on_sampler_change(on_sampler_change)
        path = checkpoint.resolve(path)  # every check that can fail runs before anything is loaded
        check_given(path, config, data, trust_code)
        cfg, state = checkpoint.load(path, config, sampler, trust_code, rewards_given=bool(data.get("reward_funcs")),
                                     environment_given=data.get("environment_factory") is not None)
        ctrl = cls.from_config(cfg if config is not None or tracking else untracked(cfg), **data)
        try:
            checkpoint.check_shapes(checkpoint.shapes(state["policy"]), checkpoint.shapes(ctrl.policy.state_dict()),
                                    repr(str(path)))
            checkpoint.check_data(state.get("data"), ctrl.task, repr(str(path)))
        except checkpoint.CheckpointError:
            ctrl.close()
            raise
        ctrl.load_state_dict(state, on_sampler_change)
        return ctrl

    def close(self) -> None:
        """Release the backends (and their Ray actors). The controller's history stays readable."""
        self._train.end_beside()  # the gap pass's thread measures with the policy: it ends first
        for backend in (self.generator, self.policy):
            backend.close()
        self._rollout.close()
        self.tracker.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Controller(T={self.trainer_version}, sampler={self.sampler!r}, buffer={self.buffer!r}, "
                f"inflight={len(self.inflight)})")


def _backend_name(part) -> str:
    return f"{part.backend}, placement {part.placement}"

