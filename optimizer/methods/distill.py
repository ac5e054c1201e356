"""Distillation of the pruned student from the dense teacher (methods.md §6): the algorithm the
heal stage (optimizer/heal.py) runs. The physically pruned model trains its
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

Observe = `step(batch)`; it is a `TrainedMethod`, so the training loop (optimizer/training.py)
checkpoints and resumes it.

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
                 blocks=None, start_digest: str | None = None):
        """`blocks`: the student's decoder blocks, which `cfg.checkpointing` wraps (adapter.blocks);
        `start_digest`: `digest` of the trained weights as they are now, where the caller has it (a
        hash of every weight: a minute at 8B)."""
        self.student, self.teacher, self.cfg = student, teacher, cfg
        self.params = trained_parameters(student)
        trained = {id(p) for p in self.params.values()}
        for p in student.parameters():
            p.requires_grad_(id(p) in trained)
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
        self.start_digest = start_digest or digest(self.params)
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


def trained_parameters(student) -> dict[str, torch.Tensor]:
    """What the heal trains: every parameter but the embedding's and the head's (frozen)."""
    frozen = {id(p) for m in (student.get_input_embeddings(), student.get_output_embeddings()) for p in m.parameters()}
    return {n: p for n, p in student.named_parameters() if id(p) not in frozen}


def digest(params: dict[str, torch.Tensor]) -> str:
    """A hash of the student's starting weights: a checkpoint resumes only the very same student."""
    h = hashlib.sha256()
    for n, p in params.items():
        h.update(n.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
