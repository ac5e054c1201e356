"""What every kind of DDP gate trains with (methods.md §1): heads and channels (`ddp.DDP`),
routed experts (`ddp_experts.ExpertGates`).

A subclass owns its gates, their forward hooks and `expected_retention(mu)`; this base owns the
rest of a step once the KD loss is backpropagated into the gates:
    c      = E[cost kept] / cost dense − ρ_t            (ρ_t falls from 1 to ρ over a warm-up)
    L      = ([λ + β c]₊² − λ²) / 2β + γ_t Σ s(1 − s) / n   (added to KD's gradient)
    λ     ← [λ + β c]₊                                  (dual ascent, every step)
and the schedules: μ_t (the score ramp's width), ρ_t, β_t, γ_t and the learning rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict

import torch

from optimizer.methods.base import TrainedMethod


class GateTraining(TrainedMethod):
    """Subclasses call `_init_training(params)` once their gates exist, and set `cfg` (a
    `ddp.DDPConfig`) first."""

    def _init_training(self, params, lam: torch.Tensor) -> None:
        self.opt = torch.optim.Adam(params, lr=self.cfg.lr)
        self.lam = lam
        self.step_count = 0

    def expected_retention(self, mu: float) -> torch.Tensor:
        raise NotImplementedError

    def budget_excess(self, mu: float, c: torch.Tensor, beta: float) -> tuple[torch.Tensor, float]:
        """The constraint the multipliers λ hold (≤ 0) and its penalty: one over the model by
        default; `ddp.DDP` holds each layer to a shape of its own instead."""
        return c, beta

    # --- schedules --------------------------------------------------------------------------
    def mu(self) -> float:
        # Held during the warm-up, while the gates sort themselves under a falling target
        # (an annealed score is flat for z > mu, so the budget would see no response);
        # then annealed geometrically so the scores approach the step 1[z > 0].
        start = self.cfg.warmup * self.cfg.steps
        t = min(1.0, max(0.0, self.step_count - start) / max(1, self.cfg.steps - 1 - start))
        return self.cfg.mu_start * (self.cfg.mu_end / self.cfg.mu_start) ** t

    def progress(self) -> float:
        """How far the run is, 0 at the first step to 1 at the last: β's, γ's and lr's schedules."""
        return min(1.0, self.step_count / max(1, self.cfg.steps - 1))

    def beta(self) -> float:
        if self.cfg.beta_start is None:
            return self.cfg.beta
        return self.cfg.beta_start * (self.cfg.beta / self.cfg.beta_start) ** self.progress()

    def lr(self) -> float:
        if self.cfg.lr_end is None:
            return self.cfg.lr
        return self.cfg.lr_end + (self.cfg.lr - self.cfg.lr_end) * (1 + math.cos(math.pi * self.progress())) / 2

    def target(self) -> float:
        # A moving target keeps c small while the gates sort themselves; a fixed one lets
        # λ wind up until every gate crosses zero at once (CoFi / Sheared-LLaMA do the same).
        return 1.0 - (1.0 - self.cfg.retain) * self.warmed_up()

    def warmed_up(self) -> float:
        """How far the warm-up has brought the target from dense to the budget, 0 to 1."""
        if self.cfg.warmup == 0:
            return 1.0
        return min(1.0, self.step_count / max(1, self.cfg.warmup * self.cfg.steps))

    # --- the step after KD's backward -------------------------------------------------------
    def descend(self, kd: float, s: torch.Tensor, mu: float) -> dict:
        """Once the KD loss `kd` is backpropagated into the gates (`ddp.kd_backward`): the
        augmented-Lagrangian budget on the scores `s`, the binarisation term, one Adam step on
        the gates, and dual ascent on λ."""
        target = self.target()
        c = self.expected_retention(mu) - target
        c_budget, beta = self.budget_excess(mu, c, self.beta())
        gamma = self.cfg.gamma * self.progress()
        # The inequality form of the augmented Lagrangian (retention at most the target): λ ≥ 0,
        # so a start under the budget invites no units back beyond what KD asks for. With the
        # equality form λ went negative from the baseline start, pulled units back in, and the
        # run ended over the target for the tie-break to cut.
        budget = ((torch.relu(self.lam + beta * c_budget) ** 2 - self.lam ** 2) / (2 * beta)).sum()
        (budget + gamma * (s * (1 - s)).mean()).backward()  # adds to KD's gradient
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.step()
        self.lam = torch.relu(self.lam + beta * c_budget.detach())
        self.step_count += 1
        return {"kd": kd, "retain": c.item() + target, "target": target, "lambda": self.lam.max().item(), "mu": mu}

    # --- checkpoint -------------------------------------------------------------------------
    def algorithm(self) -> str:
        raise NotImplementedError

    def identity(self) -> dict:
        return {"config": asdict(self.cfg), "algorithm": self.algorithm()}

    def gate_state(self) -> dict:
        raise NotImplementedError

    def load_gate_state(self, state: dict) -> None:
        raise NotImplementedError

    def state(self) -> dict:
        return {"gates": self.gate_state(), "opt": self.opt.state_dict(), "lam": self.lam,
                "step": self.step_count, "rng": torch.get_rng_state()}

    def restore(self, state: dict) -> None:
        self.load_gate_state(state["gates"])
        self.opt.load_state_dict(state["opt"])
        self.lam, self.step_count = state["lam"], state["step"]
        torch.set_rng_state(state["rng"])
