"""Generate the embedded tiny assets in ``xtl/assets/tiny/`` (deterministic, no downloads).

    python scripts/make_tiny_assets.py [--out xtl/assets/tiny] [--seed 0]

Writes a byte-level BPE tokenizer with the Qwen3 special tokens and Qwen3 chat template, a synthetic SFT task
with checkable answers (``sft_train.jsonl``, held-out ``sft_eval.jsonl`` with an ``answer`` field), preference pairs
built from it (``preference_train.jsonl``, ``preference_eval.jsonl``: the SFT prompt, its correct answer as ``chosen``
and a corrupted answer as ``rejected``), the multiple-choice rows of the shipped lm-eval task ``tiny_choice``
(``lm_eval/tiny_choice.jsonl``: each held-out question with its answer among three answers of other questions of the
same kind), unpaired preference rows for KTO made from those pairs (``kto_train.jsonl``,
``kto_eval.jsonl``: each prompt once, with its correct answer labeled true or its corrupted one labeled false, in
turn), a small pretraining text set (``pretrain.jsonl``), and the agentic task (``agent_train.jsonl``,
``agent_eval.jsonl``): three-digit products, too hard for the tiny model to compute, which a calculator tool answers.

An agent training row is a chat row (``messages``: the question, then either a call of the calculator, its result and
the number, or, for a share of the rows, a guessed number, so that the SFT model calls the tool only sometimes and RL
has something to teach; ``tools``, the calculator's schema, on a few rows) that also reads as an RL prompt row
(``prompt``, ``answer``). An agent held-out row is a prompt row on a question absent from the training rows.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Callable
from pathlib import Path

from xtl.data.tiny import QWEN3_ADDED_TOKENS, QWEN3_SPECIAL_TOKENS, build_bpe_tokenizer, tiny_assets_dir

VOCAB_SIZE = 1536
NUM_TRAIN = 6000
NUM_EVAL = 200
NUM_PRETRAIN = 3000
NUM_AGENT_TRAIN = 680
NUM_AGENT_EVAL = 100
AGENT_DIRECT_SHARE = 0.55  # the training rows that answer without the tool (a guess: the tiny model cannot multiply)
# The training rows that list the tools (their system block is ~460 tokens: listed in every row it would be most of
# the SFT's compute and of the file); the others teach the same turns in short rows.
AGENT_TOOLS_SHARE = 0.05
AGENT_THOUGHT = "Use the calculator."  # the reasoning of a tool-calling turn (qwen3 renders a turn before the
# answer with its <think> block only when the block is not empty: so the turn starts as the generation prompt does)
# transformers.utils.get_json_schema(xtl.agent_tools.calculator), written out (the generator imports no transformers)
CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'Integers or decimals with + - * / // % ** and parentheses, e.g. "123 * 456".',
                }
            },
            "required": ["expression"],
        },
        "return": {"type": "string"},
    },
}
SYSTEM = "You are a precise assistant. Answer with the result only."
WORDS = (
    "apple river stone cloud tiger lemon pencil garden rocket candle mirror forest window silver planet "
    "orange bridge winter summer dragon castle butter marble rabbit violin coffee desert island jungle "
    "meadow ocean puzzle shadow thunder valley wizard yellow zebra anchor breeze copper dolphin falcon"
).split()


# Extra vocabulary for the pretraining text only, so the BPE learns a realistic number of merges (~1.5k tokens).
TEXT_WORDS = (
    "about above across after again against almost along already always among animal answer around autumn "
    "balance basket beach beautiful because before behind believe below between bicycle birthday blanket border "
    "bottle branch bright brother building button camera capital careful carpet center chance change chapter "
    "cheese chicken children circle citizen climate clock closet coast collect colour common company compare "
    "complete computer corner cotton country courage cousin crystal culture curtain danger daughter decide "
    "deliver design detail diamond dinner direction distance doctor double dream during eagle early earth "
    "easily eleven empty energy engine enough evening example explain family famous farmer father feather "
    "festival field finger flower follow forward friend frozen future galaxy gentle giant glass golden govern "
    "gravity guitar hammer happen harbor health heavy helmet history holiday honest horizon hospital hundred "
    "hunger imagine important insect inside invent journey kettle kitchen knowledge ladder language laughter "
    "leather letter library little machine market measure medicine memory message middle minute moment monkey "
    "morning mother mountain museum music narrow nature needle neighbor nothing notice number object office "
    "orchard paper parent pattern people perfect person picture pillow pocket police popular potato powder "
    "present pretty problem promise purple question quickly railway rainbow reason record remember repeat "
    "report rhythm ribbon saddle sailor science season second secret seven shoulder signal simple sister "
    "sleepy smooth soldier special spider spring square station stomach story strange street student sudden "
    "sugar supper surface sweater system teacher temple theory thought thousand ticket tomorrow tongue travel "
    "treasure triangle trouble tunnel umbrella uncle under useful vacation village visitor voice wagon weather "
    "whisper wonder wooden worker writer yesterday"
).split()


def main() -> None:
    """Write the assets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=tiny_assets_dir())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)

    train, evals = _sft_split(rng)
    pretrain = [{"text": _paragraph(rng)} for _ in range(NUM_PRETRAIN)]
    _write_jsonl(out / "sft_train.jsonl", train)
    _write_jsonl(out / "sft_eval.jsonl", evals)
    _write_jsonl(out / "pretrain.jsonl", pretrain)
    preference_rng = random.Random(f"preference-{args.seed}")  # its own stream: the other files do not move
    pairs = {"train": preference_rows(train, preference_rng), "eval": preference_rows(evals, preference_rng)}
    for split, rows in pairs.items():
        _write_jsonl(out / f"preference_{split}.jsonl", rows)
        _write_jsonl(out / f"kto_{split}.jsonl", unpaired_rows(rows))

    choice_rng = random.Random(f"choice-{args.seed}")
    _write_jsonl(out / "lm_eval" / "tiny_choice.jsonl", choice_rows(evals, choice_rng))
    agent_train, agent_eval = agent_rows(random.Random(f"agent-{args.seed}"))
    _write_jsonl(out / "agent_train.jsonl", agent_train, compact=True)
    _write_jsonl(out / "agent_eval.jsonl", agent_eval, compact=True)

    template = (
        Path(__file__).resolve().parent.parent / "xtl" / "assets" / "chat_templates" / "qwen3.jinja"
    ).read_text()
    corpus = [p["text"] for p in pretrain] + [m["content"] for r in train for m in r["messages"]]
    tokenizer = build_bpe_tokenizer(
        corpus,
        vocab_size=VOCAB_SIZE,
        special_tokens=QWEN3_SPECIAL_TOKENS,
        added_tokens=QWEN3_ADDED_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )
    tokenizer.model_max_length = 4096
    tokenizer.save_pretrained(out)
    # The generic class name loads with any transformers that reads tokenizer.json.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(
        f"wrote {out} ({len(train)} train, {len(evals)} eval, {len(pretrain)} pretrain, preference pairs of each SFT "
        f"row, {len(agent_train)} agent train, {len(agent_eval)} agent eval; {total / 1e6:.2f} MB)"
    )


def agent_rows(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """The agentic task: questions ``What is a*b?`` on three-digit numbers.

    Args:
        rng (random.Random): Source of the questions, of which training rows guess and which list the tools.

    Returns:
        tuple[list[dict], list[dict]]: The training rows (``prompt``, ``answer``, ``messages``: a tool trace or, for
        ``AGENT_DIRECT_SHARE`` of them, a guess; ``tools`` on ``AGENT_TOOLS_SHARE`` of them) and the held-out rows
        (``prompt``, ``answer``) on other questions.
    """
    seen: set[str] = set()
    questions = []
    while len(questions) < NUM_AGENT_TRAIN + NUM_AGENT_EVAL:
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        if f"{a}*{b}" not in seen:
            seen.add(f"{a}*{b}")
            questions.append((f"{a}*{b}", str(a * b)))
    evals = [{"prompt": f"What is {e}?", "answer": answer} for e, answer in questions[:NUM_AGENT_EVAL]]
    train = []
    for expression, answer in questions[NUM_AGENT_EVAL:]:
        question = {"role": "user", "content": f"What is {expression}?"}
        if rng.random() < AGENT_DIRECT_SHARE:
            guess = str(int(answer) + rng.choice([-1, 1]) * rng.randint(1, int(answer) // 10))
            messages = [question, {"role": "assistant", "content": guess}]
        else:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
            messages = [
                question,
                {"role": "assistant", "content": "", "reasoning_content": AGENT_THOUGHT, "tool_calls": [call]},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        row = {"prompt": question["content"], "answer": answer, "messages": messages}
        if rng.random() < AGENT_TOOLS_SHARE:
            row["tools"] = [CALCULATOR_SCHEMA]
        train.append(row)
    return train, evals


def choice_rows(evals: list[dict], rng: random.Random, num_choices: int = 4) -> list[dict]:
    """Multiple-choice rows of the held-out questions: ``question``, ``choices`` (the answer and answers of other
    questions of the same kind, in a random order) and ``gold`` (the answer's index)."""
    questions = [row["messages"][-2]["content"] for row in evals]
    kinds: dict[str, list[str]] = {}
    for question, row in zip(questions, evals):
        kinds.setdefault(_kind(question), []).append(row["answer"])
    rows = []
    for question, row in zip(questions, evals):
        others = sorted({a for a in kinds[_kind(question)] if a != row["answer"]})
        choices = [row["answer"], *rng.sample(others, num_choices - 1)]
        rng.shuffle(choices)
        rows.append({"question": question, "choices": choices, "gold": choices.index(row["answer"])})
    return rows


def _kind(question: str) -> str:
    """The task a tiny question belongs to (its words before the first digit or colon)."""
    return re.split(r"[:0-9]", question, maxsplit=1)[0]


def _sft_split(rng: random.Random) -> tuple[list[dict], list[dict]]:
    tasks: list[Callable[[random.Random], tuple[str, str]]] = [_add, _next, _repeat, _upper, _count]
    seen: set[str] = set()
    evals, train = [], []
    while len(evals) < NUM_EVAL:
        prompt, answer = rng.choice(tasks)(rng)
        if prompt not in seen:
            seen.add(prompt)
            evals.append({"messages": _chat(prompt, answer, system=False), "answer": answer})
    while len(train) < NUM_TRAIN:
        prompt, answer = rng.choice(tasks)(rng)
        if prompt in seen:
            continue
        train.append({"messages": _chat(prompt, answer, system=rng.random() < 0.3)})
    return train, evals


def _chat(prompt: str, answer: str, system: bool) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


# The tasks are chosen so that a tiny model learns them in a few minutes of CPU training and its held-out exact
# match visibly rises: single-digit sums, successors, copying, uppercasing and counting short word lists.


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return f"What is {a}+{b}?", str(a + b)


def _next(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 98)
    return f"What number comes after {n}?", str(n + 1)


def _repeat(rng: random.Random) -> tuple[str, str]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
    return f"Repeat: {text}", text


def _upper(rng: random.Random) -> tuple[str, str]:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 2)))
    return f"Uppercase: {text}", text.upper()


def _count(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(rng.randint(1, 5))]
    return f"How many words: {' '.join(words)}", str(len(words))


def preference_rows(sft_rows: list[dict], rng: random.Random) -> list[dict]:
    """Preference pairs from SFT rows, in TRL's explicit-prompt conversational layout.

    Args:
        sft_rows (list[dict]): Rows ``{"messages": [..., user, assistant]}`` of the tiny SFT task.
        rng (random.Random): Source of the corruptions (seeded: the output is deterministic).

    Returns:
        list[dict]: ``{"prompt": messages without the final assistant turn, "chosen": [that turn], "rejected":
        [an assistant turn with a wrong answer]}`` per SFT row, in order.
    """
    rows = []
    for row in sft_rows:
        *prompt, answer = row["messages"]
        wrong = _corrupt(prompt[-1]["content"], answer["content"], rng)
        assert wrong != answer["content"], (prompt, wrong)
        rows.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return rows


def unpaired_rows(pairs: list[dict]) -> list[dict]:
    """Unpaired preference rows (TRL's conversational layout) from preference pairs: each prompt once, the even rows
    with their chosen answer labeled desirable, the odd rows with their rejected answer labeled undesirable.

    Args:
        pairs (list[dict]): Rows of :func:`preference_rows`.

    Returns:
        list[dict]: ``{"prompt": messages, "completion": [assistant turn], "label": bool}`` per pair, in order.
    """
    return [
        {"prompt": row["prompt"], "completion": row["chosen" if k % 2 == 0 else "rejected"], "label": k % 2 == 0}
        for k, row in enumerate(pairs)
    ]


def _corrupt(prompt: str, answer: str, rng: random.Random) -> str:
    """A wrong answer to a tiny-task prompt, wrong in a way that recurs across prompts (so that a preference for the
    right answers can be learned and checked on held-out prompts): the operands side by side for a sum, the number
    itself for its successor, a nearby wrong count, the words in reverse order (else the letters, else one word too
    many), the wrong case.
    """
    if sum_prompt := re.fullmatch(r"What is (\d+)\+(\d+)\?", prompt):
        return sum_prompt[1] + sum_prompt[2]
    if after := re.fullmatch(r"What number comes after (\d+)\?", prompt):
        return after[1]
    if prompt.startswith("How many words: "):
        n = int(answer)
        return str(n + rng.choice([1, 2]) if n < 2 else n + rng.choice([-2, -1, 1, 2]))
    if prompt.startswith("Repeat: "):
        candidates = [" ".join(reversed(answer.split())), answer[::-1], f"{answer} {answer.split()[0]}"]
        return next(c for c in candidates if c != answer)
    if prompt.startswith("Uppercase: "):
        text = prompt.removeprefix("Uppercase: ")
        return rng.choice([text, text.title(), text.capitalize()])
    raise ValueError(f"no corruption for the tiny task prompt {prompt!r}")


def _paragraph(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.randrange(3)
        if kind == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            sentences.append(f"The sum of {a} and {b} is {a + b}.")
        elif kind == 1:
            w = rng.choice(WORDS)
            sentences.append(f"The word {w} reversed is {w[::-1]} and in capitals it is {w.upper()}.")
        else:
            ws = [rng.choice(WORDS + TEXT_WORDS) for _ in range(rng.randint(3, 7))]
            sentences.append(f"A {ws[0]} saw the {' '.join(ws[1:])} near the {rng.choice(TEXT_WORDS)}.")
    return " ".join(sentences)


def _write_jsonl(path: Path, records: list[dict], compact: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    separators = (",", ":") if compact else None
    path.write_text("".join(json.dumps(r, ensure_ascii=False, separators=separators) + "\n" for r in records))


if __name__ == "__main__":
    main()
