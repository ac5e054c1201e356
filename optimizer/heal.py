"""Heal: knowledge distillation of the pruned student from the dense teacher (methods.md §6).

The stage between surgery and evaluation (`job.Job.run`): the physically pruned model trains its
decoder weights — blocks and final norm; the embedding and LM head stay frozen, so a tied head
stays tied and the vocabulary's 28% of SmolLM2's parameters carry no optimizer state — to match
the dense model's next-token distribution, KL(teacher ‖ student) per token. Shapes never change;
zeros a semi-structured method wrote are held bit for bit (their gradients dropped before clipping,
and `keep` masks reapplied after every step, so no optimizer state moves a pruned weight off zero
in the weights that ship).

The KL over the vocabulary is computed in chunks of the sequence (`kd_loss_backward`): only one
chunk's logits exist at a time, for the teacher and the student (a 262k vocabulary is 2 GB of
fp32 logits per 2048 tokens), and the student's gradient flows back through the last hidden
state once.

Observe = `step(batch)`; it is a `TrainedMethod`, so the job's loop checkpoints and resumes it.

Two memory recipes (`--heal-memory`, docs/heal.md "Memory"): `fast` keeps every activation for
the backward pass and trains with AdamW (two fp32 moments a weight); `lean` checkpoints the
activations per block (a block's forward keeps only its input and is recomputed in the
backward: the same gradients, one more forward pass of each block), trains with Adafactor
(torch.optim.Adafactor: a factored second moment, a row and a column per matrix, no first
moment) and holds the teacher in bf16, which is what lets one 80 GB GPU heal an 8B model.

Several processes (`torch.distributed`, any backend: NCCL on GPUs, gloo on CPUs) train data
parallel: every rank holds the student and the teacher, takes its share of each step's batch
(sequences rank, rank + world, ...), and the gradients are summed across ranks before the step,
so every rank takes the same step as one process with the whole batch would.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from optimizer import distributed
from optimizer.evaluate import head_logits
from optimizer.methods.base import TrainedMethod

ALGORITHM = ("heal-3: logit KL(teacher || student), chunked; blocks and final norm train; AdamW (fused) or Adafactor, cosine; "
             "held zeros' gradients dropped before clipping")  # a checkpoint of another version is not resumed

# Each optimizer's peak and final learning rate by default. AdamW's is absolute (selected:
# bench/results/heal-select/); Adafactor's step is relative to each weight's RMS, and 1e-2 (torch's
# default) is about AdamW's 3e-4 on SmolLM2's linear weights (RMS ~0.03); its end keeps AdamW's
# ratio of a thirtieth.
OPTIMIZER_LR = {"adamw": (3e-4, 1e-5), "adafactor": (1e-2, 1e-2 / 30)}
# A heal at the default peak that raises the held-out KL is retried once at peak / this (Gemma-3-270M
# at retain 0.7: 3e-4 raised it, 1e-4 lowered it; bench/results/heal-select/2026-12-04-gemma-lr).
RETRY_LR_DIVISOR = 3


@dataclass
class HealConfig:
    steps: int
    lr: float = 3e-4
    lr_end: float = 1e-5           # cosine from lr to this
    warmup: float = 0.05           # fraction of steps of linear warm-up
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kl_chunk: int = 256            # tokens of logits held at once
    dtype: str = "float32"         # "bfloat16": forward passes under autocast (weights, states fp32)
    optimizer: str = "adamw"       # adamw | adafactor (OPTIMIZER_LR)
    checkpointing: bool = False    # recompute each block's activations in the backward pass
    seed: int = 0


class Distillation(TrainedMethod):
    def __init__(self, student, teacher, cfg: HealConfig, keep: dict[str, torch.Tensor] | None = None,
                 blocks=None):
        """`blocks`: the student's decoder blocks, which `cfg.checkpointing` wraps (adapter.blocks)."""
        self.student, self.teacher, self.cfg = student, teacher, cfg
        frozen = {id(p) for m in (student.get_input_embeddings(), student.get_output_embeddings()) for p in m.parameters()}
        self.params = {n: p for n, p in student.named_parameters() if id(p) not in frozen}
        for p in student.parameters():
            p.requires_grad_(id(p) not in frozen)
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.keep = keep or {}
        params = list(self.params.values())
        if cfg.optimizer == "adamw":
            # the fused kernel: the same update (rounded its own way) in one pass over the weights,
            # several times faster on a CPU than the per-tensor loop; it counts where steps are small
            fused = all(p.device.type in ("cpu", "cuda") for p in params)
            self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused or None)
        elif cfg.optimizer == "adafactor":
            self.opt = torch.optim.Adafactor(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        else:
            raise ValueError(f"unknown heal optimizer {cfg.optimizer!r}")
        if cfg.checkpointing and blocks is None:
            raise ValueError("activation checkpointing needs the student's blocks")
        self._unwrap = checkpoint_blocks(blocks) if cfg.checkpointing else None
        self.heads = cast_heads(teacher, student, cfg.dtype)
        self.step_count = 0
        self.start_digest = digest(self.params)
        student.train(False)  # no dropout: the student is compared token for token with the teacher

    def lr(self) -> float:
        warm = max(1, round(self.cfg.warmup * self.cfg.steps))
        if self.step_count < warm:
            return self.cfg.lr * (self.step_count + 1) / warm
        t = min(1.0, (self.step_count - warm) / max(1, self.cfg.steps - 1 - warm))
        return self.cfg.lr_end + (self.cfg.lr - self.cfg.lr_end) * (1 + math.cos(math.pi * t)) / 2

    def step(self, input_ids: torch.Tensor) -> dict:
        self.opt.zero_grad(set_to_none=True)
        rank, world = distributed.rank_world()
        kd = 0.0
        input_ids = input_ids.to(next(self.student.parameters()).device)
        for seq in input_ids[rank::world].split(1):  # one sequence's activations at a time
            kd += kd_loss_backward(self.student, self.teacher, seq, self.cfg.kl_chunk, self.cfg.dtype,
                                   scale=1 / len(input_ids), heads=self.heads) / len(input_ids)
        if world > 1:
            kd = _sum_across_ranks(list(self.params.values()), kd)
        self.drop_zeros_grads()  # before clipping: the held zeros' gradients must not count in the norm
        norm = torch.nn.utils.clip_grad_norm_(list(self.params.values()), self.cfg.grad_clip)
        lr = self.lr()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self.hold_zeros()
        self.step_count += 1
        return {"kd": kd, "lr": lr, "grad_norm": float(norm)}

    @torch.no_grad()
    def drop_zeros_grads(self) -> None:
        for name, keep in self.keep.items():
            grad = self.params[name].grad
            if grad is not None:
                grad.masked_fill_(~keep, 0)

    @torch.no_grad()
    def hold_zeros(self) -> None:
        for name, keep in self.keep.items():
            self.params[name].masked_fill_(~keep, 0)

    def close(self) -> None:
        for p in self.student.parameters():
            p.requires_grad_(False)
        if self._unwrap:
            self._unwrap()
            self._unwrap = None

    # --- checkpoint / resume ---------------------------------------------------------------
    def identity(self) -> dict:
        return {"config": asdict(self.cfg), "algorithm": ALGORITHM, "student": self.start_digest}

    def state(self) -> dict:
        return {"params": {n: p.detach() for n, p in self.params.items()}, "opt": self.opt.state_dict(),
                "step": self.step_count, "rng": torch.get_rng_state()}

    def restore(self, state: dict) -> None:
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(state["params"][n])
        self.opt.load_state_dict(state["opt"])
        self.step_count = state["step"]
        torch.set_rng_state(state["rng"])

    def state_bytes(self) -> dict:
        """Bytes of what training holds beside the teacher: the trainable weights, their gradients
        (as large), and the optimizer's state as it is (after a step: AdamW's two moments, or
        Adafactor's rows and columns)."""
        trainable = sum(p.numel() * p.element_size() for p in self.params.values())
        state = sum(t.numel() * t.element_size() for st in self.opt.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.dim() > 0)
        return {"trainable_params": sum(p.numel() for p in self.params.values()), "weights": trainable,
                "grads": trainable, "optimizer": self.cfg.optimizer, "optimizer_state": state}


def checkpoint_blocks(blocks):
    """Activation checkpointing: each block's forward, while gradients are recorded, keeps only its
    inputs and recomputes itself in the backward pass (torch.utils.checkpoint, non-reentrant, the
    autocast and RNG state replayed: the same gradients). Returns the function that unwraps them."""
    from torch.utils.checkpoint import checkpoint
    wrapped = []
    for block in blocks:
        own = block.__dict__.get("forward")  # a forward set on the instance (a hook library's), else None
        forward = block.forward

        def recomputed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = recomputed
        wrapped.append((block, own))

    def unwrap() -> None:
        for block, own in wrapped:
            if own is None:
                del block.forward
            else:
                block.forward = own
    return unwrap


def _sum_across_ranks(params: list[torch.Tensor], kd: float) -> float:
    """All-reduce (sum) every gradient, in one flat buffer, and the loss: each rank's share was
    scaled by 1 / the whole batch, so the sums are the batch's mean."""
    import torch.distributed as dist
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.flatten() for g in grads] + [torch.tensor([kd], dtype=grads[0].dtype, device=grads[0].device)])
    dist.all_reduce(flat)
    offset = 0
    for p, g in zip(params, grads):
        summed = flat[offset:offset + g.numel()].view_as(g)
        if p.grad is None:
            p.grad = summed.clone()
        else:
            p.grad.copy_(summed)
        offset += g.numel()
    return float(flat[-1])


def cast_heads(teacher, student, dtype: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The teacher's and the student's frozen head weights in bf16 for `kd_loss_backward`, cast once
    for the whole heal: autocast casts a weight that needs no gradient again at every use
    (bench/results/heal-step/2026-12-06-2bea962). None where there is nothing to
    cast (fp32 passes, a head that trains); a head already in bf16 is not copied."""
    if dtype != "bfloat16":
        return None, None
    weights = (m.get_output_embeddings().weight for m in (teacher, student))
    return tuple(None if w.requires_grad else w.detach().to(torch.bfloat16) for w in weights)


def kd_loss_backward(student, teacher, input_ids: torch.Tensor, chunk: int, dtype: str = "float32",
                     scale: float = 1.0, heads: tuple = (None, None)) -> float:
    """KL(teacher ‖ student) per token of `input_ids` [1, T], backpropagated (times `scale`) into
    the student; the logits exist one chunk of `chunk` tokens at a time. `heads`: `cast_heads`'s.
    Returns the mean KL."""
    if input_ids.shape[0] != 1:
        raise ValueError(f"kd_loss_backward takes one sequence [1, T], not {list(input_ids.shape)}")
    autocast = torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    with torch.no_grad(), autocast:
        t_hidden = teacher.get_decoder()(input_ids, use_cache=False).last_hidden_state[0]
    with autocast:
        # no KV cache: it would hold every block's keys and values, and a block recomputed in the
        # backward pass (--heal-memory lean) would append to it a second time
        s_hidden = student.get_decoder()(input_ids, use_cache=False).last_hidden_state[0]
    # The head takes [tokens, hidden]: given [1, tokens, hidden] that needs a gradient, torch's
    # matmul under autocast copies the transposed head weight at every chunk instead of folding the
    # tokens into one matrix product.
    h = s_hidden.detach().requires_grad_(True)
    n, total = input_ids.numel(), 0.0
    for i in range(0, h.shape[0], chunk):
        with torch.no_grad(), autocast:
            t_logp = F.log_softmax(head_logits(teacher, t_hidden[i:i + chunk], heads[0]).float(), dim=-1)
        with autocast:
            s_logits = head_logits(student, h[i:i + chunk], heads[1])
        s_logp = F.log_softmax(s_logits.float(), dim=-1)
        kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="sum") / n
        (kl * scale).backward()
        total += kl.item()
    s_hidden.backward(h.grad)
    return total


@torch.no_grad()
def kd_eval(student, teacher, windows: torch.Tensor, chunk: int = 256) -> float:
    """Mean KL(teacher ‖ student) per token over `windows`, without training."""
    total, n = 0.0, 0
    for w in windows.to(next(student.parameters()).device):
        t_hidden = teacher.get_decoder()(w[None], use_cache=False).last_hidden_state[0]
        s_hidden = student.get_decoder()(w[None], use_cache=False).last_hidden_state[0]
        for i in range(0, w.numel(), chunk):
            t_logp = F.log_softmax(head_logits(teacher, t_hidden[i:i + chunk]).float(), -1)
            s_logp = F.log_softmax(head_logits(student, s_hidden[i:i + chunk]).float(), -1)
            total += F.kl_div(s_logp, t_logp, log_target=True, reduction="sum").item()
        n += w.numel()
    return total / n


def zero_masks(model, adapter) -> dict[str, torch.Tensor]:
    """{parameter name: keep mask} of the blocks' Linear weights that hold zeros (semi-structured)."""
    names = {id(p): n for n, p in model.named_parameters()}
    keep = {}
    for block in adapter.blocks(model):
        for lin in adapter.linears(block).values():
            w = lin.weight.detach()
            if (w == 0).any():
                keep[names[id(lin.weight)]] = w != 0  # bool: a byte a weight, not a weight's copy
    return keep


def digest(params: dict[str, torch.Tensor]) -> str:
    """A hash of the student's starting weights: a checkpoint resumes only the very same student."""
    h = hashlib.sha256()
    for n, p in params.items():
        h.update(n.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


# --- the stage ----------------------------------------------------------------------------------

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


def heal_device(name: str) -> torch.device:
    """--heal-device: 'auto' is CUDA where torch sees it, else the CPU; CUDA is the first device, or
    with several processes (optimizer/distributed.py) each one's LOCAL_RANK's."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.launched() > 1:
        return torch.device("cuda", distributed.local_rank())
    return torch.device(name)


def heal(job, model):
    """The heal stage (job.Job.run): distil `model` (the deployable student) from `job.teacher`
    for `job.cfg.heal.tokens` tokens (at most `time_s` seconds); returns it healed, and leaves the
    manifest's account in `job.heal_detail`. Student and teacher train on `--heal-device` and come
    back to the CPU, where the stages after this one expect them."""
    device = heal_device(job.cfg.heal.device)
    model.to(device)
    if job.cfg.heal.memory == "lean":  # the teacher only runs forward passes: bf16 halves it (cast
        job.teacher.to(torch.bfloat16)  # before the move, so that no fp32 copy reaches the GPU)
    job.teacher.to(device)
    try:
        return _heal(job, model, device)
    finally:
        model.to("cpu")
        job.teacher.to("cpu")


def _heal(job, model, device: torch.device):
    import time

    from optimizer import evaluate
    from optimizer.methods.ddp import peak_rss_gib
    from optimizer.sequential import calibration_dtype
    s, cfg = job.cfg.heal, job.cfg
    main, world = distributed.is_main(), distributed.rank_world()[1]
    # every rank heals the same student on the same text: rank 0's (optimizer/distributed.py)
    chunks, source = distributed.broadcast_object((job.heal_data or heal_chunks(job)) if main else None)
    distributed.broadcast_model(model)
    seq, batch = chunks.shape[1], distributed.heal_batch(s.batch)  # config.heal_seq_len
    steps = max(1, s.tokens // (batch * seq))
    optimizer = "adafactor" if s.memory == "lean" else "adamw"
    lr, lr_end = OPTIMIZER_LR[optimizer]
    # the default peak, then once RETRY_LR_DIVISOR times lower if that raised the held-out KL (a
    # --heal-lr is tried alone): bench/results/heal-select/2026-12-04-gemma-lr
    peaks = [s.lr] if s.lr is not None else [lr, lr / RETRY_LR_DIVISOR]
    dtype = str(calibration_dtype(cfg.calib_dtype, device)).removeprefix("torch.")
    keep = zero_masks(model, job.adapter) if job.plan.sparsity else None
    before = {}
    if job.evaluation is not None:
        before["perplexity"] = evaluate.perplexity(model, job.evaluation.windows, "perplexity (before healing)")
    if cfg.zeroshot and main:
        before["zeroshot"] = job.zeroshot(model)
    held_out = job.calib.held_out[:, :1024]
    before["held_out_kd"] = kd_eval(model, job.teacher, held_out)
    started = time.time()
    # the heal text's content, not only its description: the teacher's sampled chat answers
    # can differ between machines and thread counts, and a checkpoint must be of this very data
    data_digest = hashlib.sha256(chunks.numpy().tobytes()).hexdigest()[:16]
    attempts = []
    for peak in peaks:
        time_left = None if s.time_s is None else s.time_s - (time.time() - started)
        time_left = distributed.broadcast_object(time_left)  # rank 0's clock: every rank retries or none
        if attempts and time_left is not None and time_left <= 0:
            break
        if attempts:
            job.log(f"trying a lower learning rate: {peak:.1e}")
        hcfg = HealConfig(steps=steps, lr=peak, lr_end=peak * lr_end / lr, seed=cfg.seed, dtype=dtype,
                          optimizer=optimizer, checkpointing=s.memory == "lean")
        distil = Distillation(model, job.teacher, hcfg, keep, blocks=job.adapter.blocks(model))
        ckpt = job.checkpoint("heal", [vars(hcfg), seq, batch, source, distil.start_digest, data_digest])
        if not attempts:  # the unhealed weights, on the CPU (the size of the student's blocks): a
            # heal that makes the held-out KL worse is not shipped
            unhealed = {n: p.detach().to("cpu", copy=True) for n, p in distil.params.items()}
        run = job.train(distil, chunks, steps, batch, ckpt, "healing" if not attempts else f"healing at lr {peak:.0e}",
                        lambda st: {"kd": f"{st['kd']:.3f}", "lr": f"{st['lr']:.1e}"}, max_time_s=time_left)
        distil.close()
        done = distil.step_count
        after = {"held_out_kd": kd_eval(model, job.teacher, held_out)}
        attempts.append({"lr": peak, "steps": done, "wall_s": run["wall_s"], "held_out_kd": after["held_out_kd"]})
        job.log(f"healed at lr {peak:.1e}: {done} steps, {done * batch * seq:,} tokens of {source} in "
                f"{run['wall_s']:.0f} s; held-out KL to the dense model {before['held_out_kd']:.4f} → "
                f"{after['held_out_kd']:.4f}")
        kept_unhealed = distributed.all_agree(after["held_out_kd"] > before["held_out_kd"])  # every rank alike
        if not kept_unhealed:
            break
        with torch.no_grad():
            for n, p in distil.params.items():
                p.copy_(unhealed[n])
        job.log(f"healing at lr {peak:.1e} made the held-out KL worse: back to the unhealed weights")
    if world > 1:
        job.log(f"healed on {world} processes, {batch // world} sequence(s) each a step")
    if kept_unhealed:
        job.log("healing made the held-out KL worse: the package keeps the unhealed weights (a lower heal.lr "
                "or other heal.data may heal this model)")
    del unhealed
    job.heal_detail = {
        "data": source, "tokens_requested": s.tokens, "tokens": done * batch * seq, "steps": done,
        "steps_planned": steps, "seq_len": seq, "batch": batch, "processes": world, "time_cap_s": s.time_s,
        "stopped_by_time": done < steps, "kept_unhealed": kept_unhealed, "config": vars(hcfg), "attempts": attempts,
        "zeros_held": len(keep or {}),
        "before": before, "after": after, "memory_bytes": distil.state_bytes(),
        "peak_rss_gib": round(peak_rss_gib(), 2), "device": str(device),
        **({"peak_device_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)} if device.type == "cuda" else {}),
        "wall_s": round(time.time() - started, 1),
        "resumed_from_step": run["resumed_from_step"], "final": run["final"], "checkpoint": run["checkpoint"],
        "chat": chat_check(job.teacher, model, job.tok) if main else [],
    }
    return model


def heal_chunks(job, files_text: str | None = None) -> tuple[torch.Tensor, str]:
    """The heal text in sequences of --heal-seq-len tokens, and what it is: the --heal-data files
    (`files_text`, where the caller has read them already), else the calibration text (without its
    held-out window), and with the built-in corpus also `data.builtin_heal_samples()`; with
    --heal-chat, a quarter of the sequences are the teacher's own chat answers (repeated as needed)."""
    from optimizer import data
    from optimizer.config import heal_seq_len
    from optimizer.errors import UserError
    s = job.cfg.heal
    if s.data:
        text = files_text if files_text is not None else heal_files_text(s.data, job.tok)
        what = "files " + ", ".join(str(p) for p in s.data)
        try:
            chunks = data.token_windows(job.tok, text, s.seq_len)
        except UserError as e:
            raise UserError(f"heal.data={','.join(str(p) for p in s.data)}: {e}") from None
    else:
        train = job.calib.train
        chunks = train.reshape(-1, heal_seq_len(s, train.shape[1]))
        what = f"the calibration text ({job.calib.text.description})"
        samples = default_heal_samples(job)
        if samples:  # Wikipedia alone heals Wikipedia: other kinds of text keep more of the model's ability
            more = []
            for text in samples.values():
                try:
                    more.append(data.token_windows(job.tok, text, chunks.shape[1]))
                except UserError:  # shorter than one heal sequence (a --heal-seq-len of tens of thousands)
                    pass
            chunks = torch.cat([chunks, *more])
            what += f", and the first 90% of exllamav2's {' / '.join(n.removesuffix('.utf8') for n in samples)} samples"
    n_chat = chat_answers(s, job.tok)
    if not n_chat:
        return chunks, what
    if job.heal_chat is None:
        job.heal_chat = teacher_chat(job.teacher, job.tok, n_chat, job.cfg.seed)
    chat = data.token_windows(job.tok, job.heal_chat, chunks.shape[1])
    repeat = max(1, round(len(chunks) / 3 / len(chat)))  # chat : rest = 1 : 3
    mixed = torch.cat([chunks, chat.repeat(repeat, 1)])
    return mixed, (f"{what}, and {n_chat} chat answers the dense model wrote ({len(chat)} sequences, "
                   f"{repeat}× each: {len(chat) * repeat} of {len(mixed)})")


def default_heal_samples(job) -> dict[str, str]:
    """The built-in samples the default heal adds to the calibration text: only where that is the
    built-in corpus (a user's --calib is their domain, and is healed on alone)."""
    from optimizer import data
    return data.builtin_heal_samples() if job.calib.text.builtin else {}


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
    from optimizer.errors import UserError
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
    import json

    from optimizer import data
    from optimizer.errors import UserError
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
        from optimizer.errors import UserError
        raise UserError("heal.chat needs a model with a chat template")
    from tqdm import tqdm
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
