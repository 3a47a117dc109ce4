"""Expert parallelism (EP): routed experts spread over ranks, tokens dispatched to them and back.

Each rank of an EP group holds a shard of every MoE layer's routed experts (``ExpertPlacement``)
and computes only those. A MoE layer on a rank with ``T`` local tokens (data-parallel attention:
each rank runs its own requests; a rank with no work joins with ``T = 0``):

1. routes its tokens (``route_sigmoid_topk``, replicated router weights);
2. counts, per destination rank, the tokens with at least one expert there: one row per
   (token, rank) pair, not per choice (DeepEP's dispatch layout: a token goes to a rank once);
3. exchanges the counts (``all_to_all_single``), then the rows, their local expert ids ``[P, k]``
   (-1: a choice owned elsewhere) and router weights ``[P, k]``;
4. runs its local experts over the received rows, grouped by expert as ``run_experts`` does, and
   sums each row's local choices;
5. sends the partial sums back (the reverse exchange) and adds them per token.

With one rank this is ``run_experts`` bit for bit; with more, only the order of the float
additions over a token's choices changes (partial sums per rank). The all-to-all pattern is
SGLang's / vLLM's EP dispatch-combine (docs: sglang expert_parallelism.md; vllm
all2all.py); the balance metric is SGLang's ``compute_utilization_rate`` (eplb/expert_distribution.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from swaserve.config import EngineConfig, ModelConfig
from swaserve.model.ep_stats import EPStats
from swaserve.model.layers import grouped_experts


class PlacementError(ValueError):
    """An expert placement that does not cover every expert exactly once, or does not fit EP."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank holds which routed experts (every expert on exactly one rank).

    Attributes:
        ranks: per rank, its experts in their local order (local index = position here).
    """

    ranks: tuple[tuple[int, ...], ...]
    n_experts: int = field(init=False)

    def __post_init__(self) -> None:
        flat = [e for r in self.ranks for e in r]
        n = len(flat)
        if not self.ranks:
            raise PlacementError("an expert placement needs at least one rank")
        if sorted(flat) != list(range(n)):
            dup = sorted({e for e in flat if flat.count(e) > 1})
            raise PlacementError(
                f"a placement must list experts 0..{n - 1} exactly once each"
                + (f" (repeated: {dup[:8]})" if dup else f" (got {sorted(flat)[:8]} ...)")
            )
        object.__setattr__(self, "n_experts", n)

    @property
    def size(self) -> int:
        """The EP size (ranks)."""
        return len(self.ranks)

    @classmethod
    def contiguous(cls, n_experts: int, ep_size: int) -> ExpertPlacement:
        """Expert ``e`` on rank ``e // (n_experts / ep_size)``.

        Raises:
            PlacementError: ``ep_size`` < 1 or does not divide ``n_experts``.
        """
        if ep_size < 1 or n_experts % ep_size:
            raise PlacementError(f"EP size {ep_size} must divide the {n_experts} routed experts")
        per = n_experts // ep_size
        return cls(tuple(tuple(range(r * per, (r + 1) * per)) for r in range(ep_size)))

    @classmethod
    def from_file(cls, path: str | Path, n_experts: int, ep_size: int) -> ExpertPlacement:
        """A JSON placement file: ``{"ranks": [[experts of rank 0], [experts of rank 1], ...]}``.

        Raises:
            PlacementError: unreadable, malformed, wrong rank count or expert set.
        """
        try:
            obj = json.loads(Path(path).read_text())
            ranks = tuple(tuple(int(e) for e in r) for r in obj["ranks"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlacementError(f"expert placement {path}: {e}") from e
        if len(ranks) != ep_size:
            raise PlacementError(f"expert placement {path} has {len(ranks)} ranks, EP size is {ep_size}")
        placement = cls(ranks)
        if placement.n_experts != n_experts:
            raise PlacementError(
                f"expert placement {path} places {placement.n_experts} experts, the model has {n_experts}"
            )
        return placement

    def owner(self) -> torch.Tensor:
        """[E] int64: the rank of each expert."""
        out = torch.empty(self.n_experts, dtype=torch.int64)
        for r, experts in enumerate(self.ranks):
            out[list(experts)] = r
        return out

    def local_index(self) -> torch.Tensor:
        """[E] int64: each expert's index within its rank's shard."""
        out = torch.empty(self.n_experts, dtype=torch.int64)
        for experts in self.ranks:
            out[list(experts)] = torch.arange(len(experts))
        return out


class ExpertComm(Protocol):
    """The collectives EP needs (``TorchComm``: torch.distributed; gloo on CPU, NCCL on CUDA)."""

    rank: int
    size: int

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """Rows ``send[sum(send_splits[:r]) : ...]`` go to rank r; returns the rows received,
        rank by rank (``recv_splits[r]`` from rank r)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[n] from every rank -> [size, n]."""
        ...


class TorchComm:
    """``ExpertComm`` over a ``torch.distributed`` process group (the default one if None).

    A dead peer makes a collective raise (connection closed), a hung one after the group's
    timeout: the caller treats either as the end of the EP instance."""

    def __init__(self, group: object | None = None) -> None:
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)  # type: ignore[arg-type]

    def all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        self._dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)  # type: ignore[arg-type]
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        outs = [torch.empty_like(x) for _ in range(self.size)]
        self._dist.all_gather(outs, x.contiguous(), group=self.group)  # type: ignore[arg-type]
        return torch.stack(outs)


class EPShard:
    """One rank's view of an EP group: placement, collectives, and the load counters.

    Args:
        placement: the experts of every rank. comm: the group's collectives (``comm.size`` must be
            the placement's size). num_moe_layers: MoE layers of the model (counters).
    """

    def __init__(self, placement: ExpertPlacement, comm: ExpertComm, num_moe_layers: int) -> None:
        if comm.size != placement.size:
            raise PlacementError(f"placement has {placement.size} ranks, the group {comm.size}")
        self.placement, self.comm = placement, comm
        self.rank = comm.rank
        self.experts = placement.ranks[self.rank]
        self._owner = placement.owner()
        self._local = placement.local_index()
        self.stats = EPStats.empty(num_moe_layers)
        self.bytes_sent = 0  # dispatch + combine payload bytes this rank sent (to itself included)
        self._device_hint = torch.device("cpu")

    def end_step(self) -> None:
        """Gather every rank's rows of this step (one all_gather; every rank calls it once per
        step) and update the balance counters."""
        mine = torch.tensor(self.stats.rows, dtype=torch.int64)
        every = self.comm.all_gather(mine.to(self._device_hint)).cpu()  # [ranks, layers]
        s = self.stats
        for layer in range(every.shape[1]):
            col = every[:, layer]
            top = int(col.max())
            if top:
                mean = float(col.double().mean())
                s.mean_sum[layer] += mean
                s.max_sum[layer] += top
                s.last[layer] = mean / top
        s.rows = [0] * len(s.rows)

    def on_device(self, device: torch.device) -> None:
        """Where collective buffers live (NCCL needs them on the rank's GPU)."""
        self._device_hint = device
        self._owner, self._local = self._owner.to(device), self._local.to(device)

    def run(
        self,
        layer: int,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> torch.Tensor:
        """EP replacement of ``run_experts`` for MoE layer ``layer`` (counter index).

        Args:
            x: [T, hidden] this rank's tokens (T may be 0). weights: [T, k] fp32; ids: [T, k]
                global expert ids. w_gate, w_up: [E_local, inter, hidden]; w_down:
                [E_local, hidden, inter], this rank's experts in placement order.

        Returns:
            [T, hidden] in x's dtype.

        Raises:
            RuntimeError: a collective failed (a peer died or timed out).
        """
        n, size = x.shape[0], self.comm.size
        k = ids.shape[1] if ids.dim() == 2 else 0
        dest = self._owner[ids] if n else ids  # [T, k] owning rank of each choice
        pair = torch.zeros(n, size, dtype=torch.bool, device=x.device)
        if n:
            pair.scatter_(1, dest, True)
        ranks_of, tokens = pair.t().nonzero(as_tuple=True)  # pairs by rank, then token
        send_counts = torch.bincount(ranks_of, minlength=size).to(torch.int64)
        recv_counts = self.comm.all_to_all(send_counts, [1] * size, [1] * size)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
        mine = dest[tokens] == ranks_of[:, None]  # [P, k] choices owned by the pair's rank
        local_ids = torch.where(mine, self._local[ids[tokens]], -1) if n else ids.new_empty(0, k)
        pair_w = torch.where(mine, weights[tokens], 0.0) if n else weights.new_empty(0, k)
        rows = x[tokens]
        self.bytes_sent += rows.numel() * rows.element_size()
        rows_in = self.comm.all_to_all(rows, send_splits, recv_splits)
        ids_in = self.comm.all_to_all(local_ids, send_splits, recv_splits)
        w_in = self.comm.all_to_all(pair_w, send_splits, recv_splits)
        partial = _local_experts(rows_in, w_in, ids_in, w_gate, w_up, w_down)
        self.stats.rows[layer] += int((ids_in >= 0).sum())
        self.bytes_sent += partial.numel() * partial.element_size()
        back = self.comm.all_to_all(partial, recv_splits, send_splits)  # [P, hidden], pair order
        out = torch.zeros_like(x)
        start = 0
        for m in send_splits:  # rank by rank: unique tokens per add, so the sum order is fixed
            if m:  # (one index_add_ with repeated indices is atomic, unordered, on CUDA)
                out.index_add_(0, tokens[start : start + m], back[start : start + m])
            start += m
        return out


def _local_experts(
    rows: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """rows [R, hidden], weights [R, k] fp32, ids [R, k] local expert ids (-1: not here) ->
    [R, hidden]: each row's sum over its local choices of weight x SwiGLU expert(row), summed in
    choice order as ``run_experts`` does."""
    r, k = ids.shape if ids.dim() == 2 else (0, 0)
    if r == 0:
        return rows.new_zeros(0, rows.shape[1] if rows.dim() == 2 else 0)
    flat = ids.reshape(-1)
    valid = (flat >= 0).nonzero(as_tuple=True)[0]  # (row, choice) slots computed here
    order = valid[torch.argsort(flat[valid], stable=True)]
    counts = torch.bincount(flat[valid], minlength=w_gate.shape[0]).tolist()
    w_sorted = weights.reshape(-1)[order].to(rows.dtype)
    per_choice = rows.new_zeros(r * k, rows.shape[1])
    if len(order):
        per_choice[order] = (
            grouped_experts(rows[order // k], counts, w_gate, w_up, w_down) * w_sorted[:, None]
        )
    return per_choice.view(r, k, -1).sum(dim=1)


def build_ep_shard(config: EngineConfig, cfg: ModelConfig, comm: ExpertComm | None) -> EPShard | None:
    """This rank's ``EPShard`` for ``config.ep_size`` (None when 1).

    Raises:
        ValueError: EP without a group, a group of another size, a model without routed experts, or
            a bad placement (``PlacementError``).
    """
    if config.ep_size == 1:
        return None
    if comm is None or comm.size != config.ep_size:
        raise ValueError(
            f"ep_size {config.ep_size} needs an EP group of that size (engine.ep_client starts one)"
        )
    moe = [i for i, t in enumerate(cfg.mlp_types) if t == "sparse"]
    if not moe or not cfg.n_routed_experts:
        raise ValueError("expert parallelism needs a model with routed experts")
    placement = (
        ExpertPlacement.from_file(config.ep_placement, cfg.n_routed_experts, config.ep_size)
        if config.ep_placement
        else ExpertPlacement.contiguous(cfg.n_routed_experts, config.ep_size)
    )
    return EPShard(placement, comm, len(moe))
