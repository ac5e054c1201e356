"""The heal's text: what the student is distilled on, read and checked before any pruning.

The --heal-data files (plain text, or JSON records with `text` or chat `messages`), else the
calibration text, and with the built-in corpus its other samples (stories, technical, code,
multilingual); with --heal-chat a quarter of the sequences are the dense model's own answers to
built-in instructions, so that an Instruct model keeps its chat behaviour. Never the evaluation
text (`eval_overlap`).
"""

from __future__ import annotations

import json
from typing import NamedTuple

import torch
from tqdm import tqdm

from optimizer import data
from optimizer.config import heal_seq_len
from optimizer.errors import UserError

AUTO_CHAT = 40  # --heal-chat's default for a model with a chat template (bench/results/heal/probes/)

CHAT_PROMPTS = ("What is the capital of France?", "Give me three tips for staying healthy.",
                "Write one sentence about the sea.")

# Instructions the teacher answers itself (`--heal-chat`), so that an Instruct model heals on
# its own chat behaviour and not only on prose. Generic, written for this tool: no evaluation
# task's questions, and none of CHAT_PROMPTS (the report's check stays unseen).
INSTRUCTIONS = (
    "Explain what a rainbow is to a child.", "Write a short poem about autumn leaves.",
    "How do I boil an egg?", "What are the benefits of reading books?", "Describe a cat in three sentences.",
    "Give me a recipe for a simple salad.", "What is photosynthesis?", "Write a haiku about the moon.",
    "How can I improve my sleep?", "Summarize the plot of Cinderella.", "What is the difference between weather and climate?",
    "Write a polite email asking for a meeting.", "List five fruits that are red.", "Why is the sky blue?",
    "How does a bicycle work?", "Give me advice for a job interview.", "What is a prime number?",
    "Write a Python function that reverses a string.", "Explain gravity in simple words.",
    "What should I pack for a weekend trip?", "Tell me a fun fact about octopuses.", "How do plants drink water?",
    "Write a short story about a lost key.", "What is the water cycle?", "How do I make my handwriting neater?",
    "Describe the taste of chocolate.", "What are the planets of the solar system?", "How do vaccines work?",
    "Give three reasons to learn a second language.", "Write a thank-you note to a teacher.",
    "What is the tallest mountain on Earth?", "How can I save money every month?", "Explain what a computer does.",
    "What is 15 multiplied by 4? Explain the steps.", "Describe a busy train station.",
    "How do bees make honey?", "Write two sentences about friendship.", "What causes the seasons?",
    "How do I take care of a houseplant?", "What is the purpose of a museum?",
)


class HealText(NamedTuple):
    chunks: torch.Tensor      # [sequences, tokens]
    description: str          # what they are, for the log and the manifest


def heal_text(s, tok, calib, chat: str | None, files_text: str | None = None) -> HealText:
    """The heal text in sequences of the heal's sequence length (`s`: config.HealSettings), and what
    it is: the --heal-data files (`files_text`, where the caller has read them already), else the
    calibration text (`calib`: job.Calibration, without its held-out window), and with the built-in
    corpus also `data.builtin_heal_samples()`; with `chat` (the teacher's answers, `teacher_chat`), a
    quarter of the sequences are those answers (repeated as needed)."""
    if s.data:
        text = files_text if files_text is not None else heal_files_text(s.data, tok)
        what = "files " + ", ".join(str(p) for p in s.data)
        try:
            chunks = data.token_windows(tok, text, s.seq_len)
        except UserError as e:
            raise UserError(f"heal.data={','.join(str(p) for p in s.data)}: {e}") from None
    else:
        train = calib.train
        chunks = train.reshape(-1, heal_seq_len(s, train.shape[1]))
        what = f"the calibration text ({calib.text.description})"
        samples = default_heal_samples(calib.text)
        if samples:  # Wikipedia alone heals Wikipedia: other kinds of text keep more of the model's ability
            more = []
            for text in samples.values():
                try:
                    more.append(data.token_windows(tok, text, chunks.shape[1]))
                except UserError:  # shorter than one heal sequence (a --heal-seq-len of tens of thousands)
                    pass
            chunks = torch.cat([chunks, *more])
            what += f", and the first 90% of exllamav2's {' / '.join(n.removesuffix('.utf8') for n in samples)} samples"
    if not chat:
        return HealText(chunks, what)
    n_chat = chat_answers(s, tok)
    answers = data.token_windows(tok, chat, chunks.shape[1])
    repeat = max(1, round(len(chunks) / 3 / len(answers)))  # chat : rest = 1 : 3
    mixed = torch.cat([chunks, answers.repeat(repeat, 1)])
    return HealText(mixed, f"{what}, and {n_chat} chat answers the dense model wrote ({len(answers)} sequences, "
                           f"{repeat}× each: {len(answers) * repeat} of {len(mixed)})")


def default_heal_samples(calib_text: data.Text) -> dict[str, str]:
    """The built-in samples the default heal adds to the calibration text: only where that is the
    built-in corpus (a user's --calib is their domain, and is healed on alone)."""
    return data.builtin_heal_samples() if calib_text.builtin else {}


def chat_answers(s, tok) -> int:
    """How many chat answers the teacher writes: --heal-chat, or by default (None) AUTO_CHAT
    where the model has a chat template (an Instruct model) and none where it has not."""
    if s.chat is not None:
        return s.chat
    return AUTO_CHAT if getattr(tok, "chat_template", None) else 0


def heal_files_text(paths, tok) -> str:
    return "\n\n".join(read_heal_file(p, tok) for p in paths)


def read_heal_file(path: str, tok) -> str:
    """Plain text, or JSON records (`.jsonl`, `.json`) that carry `text` or chat `messages`
    (rendered with the model's chat template)."""
    records = heal_records(path)
    if isinstance(records, str):
        return records
    pieces = []
    for rec in records:
        if isinstance(rec, str):
            pieces.append(rec)
        elif not getattr(tok, "chat_template", None):
            raise UserError(f"heal data file {path}: chat `messages`, but the model has no chat template")
        else:
            pieces.append(tok.apply_chat_template(rec, tokenize=False))
    return "\n\n".join(pieces)


def heal_records(path: str) -> str | list:
    """A heal data file without the tokenizer: its text, or for `.jsonl` / `.json` its records (a
    `text` string, or a chat's `messages` list), one per line or (`.json`) one JSON array or object. Read
    when the options are checked too, so that a malformed file is a one-line error before any model
    is loaded."""
    raw = data.read_text_file(path, "heal data file").text
    suffix = str(path).lower().rsplit(".", 1)[-1]
    if suffix not in ("jsonl", "json"):
        return raw
    raw = raw.removeprefix("\ufeff")  # a byte-order mark some editors write
    whole = None
    if suffix == "json":
        try:
            whole = json.loads(raw)  # one array of records, or one record
        except ValueError:
            pass  # JSON lines
    if whole is not None:
        parsed = list(enumerate(whole if isinstance(whole, list) else [whole], 1))
    else:
        parsed = []
        for i, line in enumerate(raw.splitlines(), 1):
            if line.strip():
                try:
                    parsed.append((i, json.loads(line)))
                except ValueError:
                    raise UserError(f"heal data file {path}: line {i} is not JSON") from None
    records = []
    for i, rec in parsed:
        if isinstance(rec, dict) and isinstance(rec.get("text"), str):
            records.append(rec["text"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            records.append(rec["messages"])
        else:
            raise UserError(f"heal data file {path}: record {i} has neither a `text` string nor `messages`")
    if not records:
        raise UserError(f"heal data file {path}: no records")
    return records


def eval_overlap(heal_text: str, eval_text: str, min_chars: int = 40, n: int = 8) -> float:
    """The fraction of the evaluation text's lines (of at least `min_chars`) that the heal text
    contains, whatever its line breaks and spacing (a line inside a longer one, a paragraph
    reflowed; JSONL records are checked as rendered): a line counts when each of its runs of `n` words occurs in
    the heal text. Training on them would make the reported perplexity a memory test."""
    lines = [ln.split() for ln in eval_text.splitlines() if len(ln.strip()) >= min_chars]
    if not lines:
        return 0.0
    words = heal_text.split()
    runs: dict[int, set[int]] = {}  # run length k -> the heal text's runs of k words (hashed)

    def occurs(run: list[str]) -> bool:
        k = len(run)
        if k not in runs:
            runs[k] = {hash(tuple(words[i:i + k])) for i in range(len(words) - k + 1)}
        return hash(tuple(run)) in runs[k]

    def contained(line: list[str]) -> bool:
        k = min(n, len(line))  # a line of fewer than n words: as a whole
        return all(occurs(line[i:i + k]) for i in range(len(line) - k + 1))
    return sum(map(contained, lines)) / len(lines)


@torch.no_grad()
def teacher_chat(teacher, tok, n: int, seed: int, max_new_tokens: int = 128, batch: int = 64) -> str:
    """`n` chat turns: built-in instructions (cycled) and the teacher's sampled answers, rendered
    with the chat template, as one text. Batched wide: a decoding step reads every weight once
    whatever the batch, so one wide batch costs far less than several narrow ones; 128 tokens an
    answer keeps the default job within its 15 minutes on 2 CPU cores (README, "Healing")."""
    if not getattr(tok, "chat_template", None):
            raise UserError("heal.chat needs a model with a chat template")
    gen = torch.Generator().manual_seed(seed)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    turns = []
    prompts = [INSTRUCTIONS[i % len(INSTRUCTIONS)] for i in range(n)]
    for i in tqdm(range(0, n, batch), desc="teacher's chat answers", unit="batch"):
        rendered = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                            tokenize=False) for p in prompts[i:i + batch]]
        ids = [tok(r, add_special_tokens=False).input_ids for r in rendered]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        device = next(teacher.parameters()).device
        input_ids, mask = input_ids.to(device), mask.to(device)
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        out = teacher.generate(input_ids, attention_mask=mask, do_sample=True, temperature=0.7, top_p=0.9,
                               max_new_tokens=max_new_tokens, pad_token_id=pad)
        for p, row in zip(prompts[i:i + batch], out[:, width:]):
            answer = tok.decode(row, skip_special_tokens=True).strip()
            turns.append(tok.apply_chat_template([{"role": "user", "content": p},
                                                  {"role": "assistant", "content": answer}], tokenize=False))
    return "\n".join(turns)


@torch.no_grad()
def chat_check(teacher, student, tok, max_new_tokens: int = 32) -> list[dict]:
    """Greedy answers to a few short instructions, dense beside healed (empty without a chat template)."""
    if not getattr(tok, "chat_template", None):
        return []
    out = []
    for prompt in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        ids = ids.to(next(student.parameters()).device)
        answers = {}
        for name, m in (("dense", teacher), ("healed", student)):
            gen = m.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
            answers[name] = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        out.append({"prompt": prompt, **answers})
    return out
