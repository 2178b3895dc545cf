"""Judgers: the rewards of rollouts, behind a small payload contract.

A :class:`Judger` scores in three steps, so that what travels to the scoring code (a thread here, a Ray actor or a
judger pool elsewhere) is small and the rollout state itself is never copied:

- :meth:`Judger.preprocess` takes from a :class:`RolloutState` only the fields the score needs (a payload dict);
- :meth:`Judger.judge_payload` (async) scores a batch of payloads, one output dict per payload (``{"score": ...}``);
- :meth:`Judger.postprocess` writes an output back to its state (``state.reward``).

:meth:`BaseJudger.batch_judge` runs the payloads concurrently, in batches of :attr:`Judger.batch_size`, each batch
under :attr:`Judger.timeout_s`: a batch that raises or does not answer in time fails its own states (``status:
"failed"``, the error kept in ``state.error``, no reward), never the run. A :class:`ComposedJudger` routes states by
``data_source`` to branch judgers (several branches may score one source: their outputs are merged by ``merge_fn``)
and calls the branches' payload methods, so that branches never write one state concurrently; a judger that owns its
whole flow (a :class:`BaseJudger` that is not a :class:`Judger`) cannot be a branch.

Built-ins: :class:`MathJudger` (``math-verify``: equivalent answers, e.g. ``1/2`` and ``0.5``, score 1),
:class:`ExactMatchJudger`, :class:`RegexJudger`, :class:`FunctionJudger` and :class:`FormatJudger`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import re
import types
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xtl.errors import ConfigError
from xtl.rl.daemon_pool import DaemonThreadPool

JudgerPayload = dict[str, Any]
JudgerOutput = dict[str, float]
FAILED = "failed"
TIMED_OUT = "the judger did not answer within"  # how the error of a state whose judging timed out begins
SCORING_THREADS = 16  # the threads of SyncJudger's scoring pool (not the event loop's default pool, which
# asyncio.run waits for on exit: a hung call would hold the caller)
_POOL: DaemonThreadPool | None = None


@dataclass
class RolloutState:
    """One rollout as judgers see it.

    Attributes:
        response: The generated text.
        ground_truth: The reference answer (``None`` for judgers that need none).
        data_source: Where the prompt comes from: :class:`ComposedJudger` routes on it.
        prompt: The prompt (text or messages), for judgers that read it.
        extra: Other fields of the prompt's row a judger may read.
        reward: Written by the judger: at least ``{"score": float}``.
        status: ``"completed"`` (generated, or judged), or ``"failed"`` (the judging raised or timed out).
        error: Why the judging failed.
        messages: The conversation of a multi-turn rollout (an agent loop's prompt, turns, tool results), for
            judgers that read the whole trajectory (``None`` for single turns).
    """

    response: str
    ground_truth: Any = None
    data_source: str = "default"
    prompt: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, float] | None = None
    status: str = "completed"
    error: str | None = None
    messages: list[dict[str, Any]] | None = None


class BaseJudger(ABC):
    """A judger that owns its whole flow (:meth:`batch_judge`); prefer :class:`Judger`."""

    async def judge(self, state: RolloutState) -> RolloutState:
        """Score one state (it is updated in place and returned)."""
        return (await self.batch_judge([state]))[0]

    @abstractmethod
    async def batch_judge(self, states: Sequence[RolloutState]) -> list[RolloutState]:
        """Score several states (updated in place and returned, in order)."""

    def judge_sync(self, states: Sequence[RolloutState]) -> list[RolloutState]:
        """:meth:`batch_judge` from synchronous code (a training step), also where an event loop already runs in
        this thread (a notebook): the judging then runs on an event loop of its own, in a daemon thread (which a hung
        judging never keeps from exiting)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.batch_judge(states))
        pool = DaemonThreadPool(1, "xtl-judge-loop")
        judged = pool.submit(asyncio.run, self.batch_judge(states))
        pool.shutdown(wait=False)  # its thread ends after this call
        return judged.result()

    def describe(self) -> str:
        """The judger as messages name it (its class)."""
        return type(self).__name__

    def state_dict(self) -> dict[str, Any]:
        """What resumes the judger exactly (e.g. the state of a random generator it samples with); none here."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (optional hook: nothing to do by default)
        """Restore :meth:`state_dict`."""


class Judger(BaseJudger):
    """A judger behind the payload contract (module docstring).

    Args:
        timeout_s: Seconds a batch of payloads may take before its states fail.
        batch_size: Payloads per :meth:`judge_payload` call (``1``: each sample alone, so a bad one fails alone).
    """

    def __init__(self, timeout_s: float = 30.0, batch_size: int = 1) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"{type(self).__name__}: timeout_s must be > 0, got {timeout_s}")
        if batch_size < 1:
            raise ConfigError(f"{type(self).__name__}: batch_size must be >= 1, got {batch_size}")
        self.timeout_s = timeout_s
        self.batch_size = batch_size

    def preprocess(self, state: RolloutState) -> JudgerPayload:
        """The fields the score needs (default: the response and the ground truth)."""
        return {"response": state.response, "ground_truth": state.ground_truth}

    @abstractmethod
    async def judge_payload(self, payloads: list[JudgerPayload]) -> list[JudgerOutput]:
        """One output (``{"score": float, ...}``) per payload, in order."""

    def postprocess(self, state: RolloutState, output: JudgerOutput) -> RolloutState:
        """Write the output to the state (default: ``state.reward = output``)."""
        state.reward = dict(output)
        return state

    async def batch_judge(self, states: Sequence[RolloutState]) -> list[RolloutState]:
        outputs = await self.outputs([self.preprocess(s) for s in states])
        for state, output in zip(states, outputs):
            if isinstance(output, BaseException):
                _fail(state, output, self.timeout_s)
            else:
                self.postprocess(state, output)
        return list(states)

    async def outputs(self, payloads: list[JudgerPayload]) -> list[JudgerOutput | BaseException]:
        """The output of every payload, or the exception that failed its batch (a timeout among them)."""
        batches = [payloads[i : i + self.batch_size] for i in range(0, len(payloads), self.batch_size)]
        results = await asyncio.gather(*(self._bounded(batch) for batch in batches), return_exceptions=True)
        outputs: list[JudgerOutput | BaseException] = []
        for batch, result in zip(batches, results):
            if not isinstance(result, BaseException) and len(result) != len(batch):
                result = ValueError(f"{type(self).__name__} returned {len(result)} outputs for {len(batch)} payloads")
            outputs += [result] * len(batch) if isinstance(result, BaseException) else list(result)
        return outputs

    async def _bounded(self, batch: list[JudgerPayload]) -> list[JudgerOutput]:
        return await asyncio.wait_for(self.judge_payload(batch), timeout=self.timeout_s)


class SyncJudger(Judger):
    """A judger whose score is a plain function of one payload, run in a worker thread of its own pool (a hung call
    costs its sample once the timeout passes and the judging goes on; the thread itself cannot be stopped: it holds
    one of the pool's :data:`SCORING_THREADS` until the call returns, a daemon thread that never keeps the process
    from exiting)."""

    @abstractmethod
    def score(self, payload: JudgerPayload) -> float | JudgerOutput:
        """The score of one payload: a number, or an output dict with ``"score"``."""

    async def judge_payload(self, payloads: list[JudgerPayload]) -> list[JudgerOutput]:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(*(loop.run_in_executor(_scoring_pool(), self.score, p) for p in payloads))
        return [r if isinstance(r, dict) else {"score": float(r)} for r in results]


class ComposedJudger(BaseJudger):
    """Routes states by ``data_source`` to branch judgers and merges their outputs.

    Args:
        branches: ``data_source -> judger`` or ``-> [judgers]`` (every one scores the source's states); ``"*"``: the
            branch of sources not named.
        merge_fn: Several outputs of one state -> its reward (default: ``score`` is the sum of the branches'
            scores, and each branch's output is kept under ``<class name>/<key>``).

    Raises:
        ConfigError: A branch that is not a :class:`Judger` (it owns its flow, and would write the shared state).
    """

    def __init__(
        self,
        branches: dict[str, Judger | Sequence[Judger]],
        merge_fn: Callable[[list[JudgerOutput], list[Judger]], JudgerOutput] | None = None,
    ) -> None:
        self.branches: dict[str, list[Judger]] = {}
        for source, judgers in branches.items():
            judgers = [judgers] if isinstance(judgers, BaseJudger) else list(judgers)
            for judger in judgers:
                if not isinstance(judger, Judger):
                    raise ConfigError(
                        f"ComposedJudger: the branch of {source!r} is a {type(judger).__name__}, which owns its whole "
                        "judging flow; branches follow the payload contract: subclass xtl.rl.Judger (preprocess, "
                        "judge_payload, postprocess)"
                    )
            if not judgers:
                raise ConfigError(f"ComposedJudger: the branch of {source!r} has no judger")
            self.branches[source] = judgers
        self.merge_fn = merge_fn or _sum_scores

    async def batch_judge(self, states: Sequence[RolloutState]) -> list[RolloutState]:
        routed = [self._route(state) for state in states]
        jobs = []  # (judger, indices of its states)
        for judger in {id(j): j for js in routed for j in js}.values():
            jobs.append((judger, [i for i, js in enumerate(routed) if judger in js]))
        results = await asyncio.gather(*(j.outputs([j.preprocess(states[i]) for i in idx]) for j, idx in jobs))
        per_state: list[list[tuple[Judger, JudgerOutput | BaseException]]] = [[] for _ in states]
        for (judger, indices), outputs in zip(jobs, results):
            for i, output in zip(indices, outputs):
                per_state[i].append((judger, output))
        for state, judged in zip(states, per_state):
            failed = [(j, o) for j, o in judged if isinstance(o, BaseException)]
            if failed:
                _fail(state, failed[0][1], failed[0][0].timeout_s)
            elif len(judged) == 1:
                judged[0][0].postprocess(state, judged[0][1])  # type: ignore[arg-type]
            else:
                state.reward = self.merge_fn([o for _, o in judged], [j for j, _ in judged])  # type: ignore[misc]
        return list(states)

    def state_dict(self) -> dict[str, Any]:
        """Each branch judger's state, by data source and position."""
        return {f"{source}/{i}": j.state_dict() for source, js in self.branches.items() for i, j in enumerate(js)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        for source, judgers in self.branches.items():
            for i, judger in enumerate(judgers):
                judger.load_state_dict(state.get(f"{source}/{i}", {}))

    def _route(self, state: RolloutState) -> list[Judger]:
        judgers = self.branches.get(state.data_source) or self.branches.get("*")
        if judgers is None:
            raise ConfigError(
                f"ComposedJudger: no branch for data_source {state.data_source!r} (branches: "
                f"{sorted(self.branches)}); add one, or a '*' branch for the others"
            )
        return judgers


class MathJudger(SyncJudger):
    """1 when the response's final answer equals the ground truth mathematically (``math-verify``: LaTeX or plain
    expressions, ``\\boxed{}`` preferred), else 0; 0 too when the response has no answer to parse."""

    def score(self, payload: JudgerPayload) -> float:
        parse, verify = _math_verify()
        gold = _parsed_truth(str(payload["ground_truth"]))
        # math-verify's time-outs use signals (main thread only): off here, the judger's own time-out applies
        answer = parse(str(payload["response"]), parsing_timeout=None)
        return float(bool(gold) and bool(answer) and verify(gold, answer, timeout_seconds=None))


class ExactMatchJudger(SyncJudger):
    """1 when the response equals the ground truth (stripped; ``ignore_case``), else 0."""

    def __init__(self, ignore_case: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_case = ignore_case

    def score(self, payload: JudgerPayload) -> float:
        got, want = str(payload["response"]).strip(), str(payload["ground_truth"]).strip()
        return float(got.lower() == want.lower() if self.ignore_case else got == want)


class RegexJudger(SyncJudger):
    """1 when the answer the regex extracts from the response (its first group, or the whole match; the last match)
    equals the ground truth, else 0 (and 0 without a match)."""

    def __init__(self, pattern: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        try:
            self.pattern = re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"RegexJudger: pattern {pattern!r} is not a regular expression ({err})") from err

    def score(self, payload: JudgerPayload) -> float:
        matches = list(self.pattern.finditer(str(payload["response"])))
        if not matches:
            return 0.0
        last = matches[-1]
        answer = last.group(1) if self.pattern.groups else last.group(0)
        return float(answer.strip() == str(payload["ground_truth"]).strip())


class FormatJudger(SyncJudger):
    """``reward`` when the whole response matches the format regex (e.g. a thinking block, then an answer), else 0."""

    def __init__(self, pattern: str, reward: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        try:
            self.pattern = re.compile(pattern, re.DOTALL)
        except re.error as err:
            raise ConfigError(f"FormatJudger: pattern {pattern!r} is not a regular expression ({err})") from err
        self.reward = reward

    def preprocess(self, state: RolloutState) -> JudgerPayload:
        return {"response": state.response}

    def score(self, payload: JudgerPayload) -> float:
        return self.reward if self.pattern.fullmatch(str(payload["response"])) else 0.0


class FunctionJudger(SyncJudger):
    """A Python function as judger: ``fn(response, ground_truth, **extra) -> float | {"score": ...}``.

    Args:
        fn: The function, or its import path ``"package.module:function"`` (as YAML names it).
    """

    def __init__(self, fn: str | Callable[..., float | JudgerOutput], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fn = _import_function(fn) if isinstance(fn, str) else fn
        self.fn_name = fn if isinstance(fn, str) else _function_name(fn)

    def describe(self) -> str:
        """The class and the function (``FunctionJudger (package.module:function)``)."""
        return f"{type(self).__name__} ({self.fn_name})"

    def preprocess(self, state: RolloutState) -> JudgerPayload:
        return {"response": state.response, "ground_truth": state.ground_truth, "extra": dict(state.extra)}

    def score(self, payload: JudgerPayload) -> float | JudgerOutput:
        return self.fn(payload["response"], payload["ground_truth"], **payload["extra"])


def _scoring_pool() -> DaemonThreadPool:
    """The scoring threads: daemon threads, which a hung call never keeps from exiting (:mod:`xtl.rl.daemon_pool`)."""
    global _POOL
    if _POOL is None:
        _POOL = DaemonThreadPool(SCORING_THREADS, "xtl-judger")
    return _POOL


@functools.cache
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """math-verify's ``parse`` and ``verify``, imported once (an import per score takes the import lock, which the
    scoring threads then wait on), its logger quieted once (not its note that its time-outs are off)."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return parse, verify


@functools.lru_cache(maxsize=4096)
def _parsed_truth(truth: str) -> list[Any]:
    """A ground truth parsed by math-verify (as LaTeX if plain parsing finds nothing), once per distinct truth: a
    group's completions share theirs. ``verify`` only reads it."""
    parse = _math_verify()[0]
    return parse(truth, parsing_timeout=None) or parse(f"${truth}$", parsing_timeout=None)


def _fail(state: RolloutState, error: BaseException, timeout_s: float) -> None:
    state.status, state.reward = FAILED, None
    if isinstance(error, TimeoutError):
        state.error = f"{TIMED_OUT} {timeout_s:g} s"
    else:
        state.error = f"{type(error).__name__}: {error}"


def _sum_scores(outputs: list[JudgerOutput], judgers: list[Judger]) -> JudgerOutput:
    merged: JudgerOutput = {"score": float(sum(o["score"] for o in outputs))}
    for output, judger in zip(outputs, judgers):
        merged.update({f"{type(judger).__name__}/{key}": float(value) for key, value in output.items()})
    return merged


def _function_name(fn: Callable[..., Any]) -> str:
    """``module:qualified name`` of a function, the class of another callable."""
    if isinstance(fn, types.FunctionType | types.MethodType):
        return f"{fn.__module__}:{fn.__qualname__}"
    return f"{type(fn).__module__}:{type(fn).__qualname__} instance"


def _import_function(path: str) -> Callable[..., Any]:
    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"FunctionJudger: cannot import {path!r} ({err}); name it as 'package.module:function'"
        ) from err
    if not callable(fn):
        raise ConfigError(f"FunctionJudger: {path!r} is not a function")
    return fn
