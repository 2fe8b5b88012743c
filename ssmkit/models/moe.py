"""A sparse mixture-of-experts MLP: a linear router sends each token to k of E gated MLPs (Jamba).

Jamba (Lieber et al. 2024, arXiv 2403.19887, sections 2-3) replaces the MLP of every other layer
by E experts, each the gated MLP of dense blocks (:class:`~ssmkit.models.mlp.GatedMLP`), and a
router; each token runs through its top k (Jamba: 2 of 16), so a layer holds E MLPs' parameters
but spends k MLPs' compute per token. For a token x (d_model,), with router weight W_r (E, d_model):

    p(x)  = softmax(W_r x)                     (E,)   every expert's probability, in fp32
    T(x)  = top-k indices of p(x)                      the experts x runs through
    y(x)  = Σ_{e ∈ T(x)} p_e(x) · MLP_e(x)             the chosen probabilities, NOT renormalised

as transformers' ``JambaTopKRouter`` / ``JambaExperts`` compute it (Mixtral instead divides the k
weights by their sum; Jamba does not). The weights are cast back to the input's dtype before the
experts' outputs are scaled and summed, experts in index order.

The router's load-balancing loss is the Switch Transformer's (Fedus et al. 2021, arXiv 2101.03961,
equations 4-6), with the top-k count of transformers' ``load_balancing_loss_func``:

    f_i = (1/T) Σ_x #{i ∈ T(x)}    the fraction of tokens routed to expert i   (eq. 5; Σ_i f_i = k)
    P_i = (1/T) Σ_x p_i(x)         the router's mean probability for expert i  (eq. 6)
    loss = E · Σ_i f_i · P_i                                                  (eq. 4, without α)

minimal (k) when both are uniform. f and P are pooled over the tokens of every MoE layer (T counts
each layer's tokens), as transformers concatenates the layers' router logits; padding (an
attention mask's 0s) is left out of both. Only P carries a gradient: it pushes the router towards
the experts that get fewer tokens. The LM adds ``router_aux_loss_coef`` (α) times it to its loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mlp import GatedMLP


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Jamba's routing: router_logits (tokens, E) -> (weights (tokens, k) fp32, experts (tokens, k)
    int64): the top-k of the softmax over all E experts, in fp32 (fp64 for fp64 logits), left
    unnormalised."""
    probs = F.softmax(
        router_logits, dim=-1, dtype=torch.promote_types(router_logits.dtype, torch.float32)
    )
    return torch.topk(probs, top_k, dim=-1)


class SparseMoE(nn.Module):
    """(..., d_model) -> (..., d_model): ``num_experts`` gated MLPs of width ``d_intermediate``
    (each a :class:`GatedMLP`, so rounded up to 128 as the dense MLP) behind a linear router (E,
    d_model) without bias; each token through its ``top_k`` experts (module docstring).

    When ``keep_router_logits`` is set (the LM sets it for a forward that needs the load-balancing
    loss, and clears it after), the forward leaves its router logits (tokens, E) in
    ``router_logits`` for the LM to collect: the blocks' signature stays the dense one, and a
    recomputation under activation checkpointing (flag cleared by then) leaves nothing behind."""

    def __init__(
        self,
        d_model: int,
        d_intermediate: int,
        num_experts: int,
        top_k: int,
        activation: str = "silu",
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..num_experts={num_experts}; got {top_k}")
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(d_model, d_intermediate, activation=activation) for _ in range(num_experts)
        )
        self.keep_router_logits = False
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, d_model)
        logits = self.router(x)  # (tokens, E)
        if self.keep_router_logits:
            self.router_logits = logits
        weights, chosen = route(logits, self.top_k)  # (tokens, k) each
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        # Every expert runs, on the tokens that chose it (maybe none): each expert's weights are in
        # every step's graph, so DDP finds no unused parameter when the router skips one.
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)  # (n_e,) each: which tokens, at which rank
            y = expert(x[token]) * weights[token, slot, None]  # (n_e, d_model)
            out.index_add_(0, token, y)
        return out.reshape(shape)

    def expert_numel(self) -> int:
        """Parameters of one expert (all experts are the same shape)."""
        return sum(p.numel() for p in self.experts[0].parameters())

    def inactive_numel(self) -> int:
        """Parameters a token does not use: the E - k experts it is not routed to."""
        return (self.num_experts - self.top_k) * self.expert_numel()


def load_balancing_loss(
    router_logits: list[torch.Tensor] | tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss E · Σ_i f_i · P_i (Fedus et al. 2021, eqs. 4-6;
    module docstring), pooled over the layers as transformers' ``load_balancing_loss_func`` does.

    router_logits: one (batch·seqlen, E) tensor per MoE layer; attention_mask: (batch, seqlen), 0
    at padding, which then counts in neither f nor P. Returns a scalar fp32 tensor (0 without
    layers)."""
    if not router_logits:
        return torch.zeros(())
    device = router_logits[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)  # Σ_x #{i ∈ T(x)}
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)  # Σ_x p_i(x)
    rows = torch.zeros((), dtype=torch.float32, device=device)  # T
    mask = None if attention_mask is None else attention_mask.reshape(-1, 1).to(device).float()
    for logits in router_logits:
        probs = F.softmax(logits.float(), dim=-1)  # (tokens, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (tokens, k)
        hits = F.one_hot(chosen, num_experts).sum(dim=1).float()  # (tokens, E): 1 where chosen
        if mask is not None:
            hits, probs = hits * mask, probs * mask
        counts = counts + hits.sum(dim=0)
        prob_sum = prob_sum + probs.sum(dim=0)
        rows = rows + (probs.shape[0] if mask is None else mask.sum())
    f, P = counts / rows, prob_sum / rows  # eqs. 5 and 6
    return num_experts * (f * P).sum()  # eq. 4


__all__ = ["SparseMoE", "load_balancing_loss", "route"]
